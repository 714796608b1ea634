"""Dr.GRPO ("Understanding R1-Zero-Like Training"): no std scaling, no length normalization."""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.rl.transforms = (("group_advantages", {"kind": "dr_grpo"}),)
    c.loss.aggregation = "seq-mean-token-sum-norm"
    c.loss.max_len = c.sampling.get_ref("max_new_tokens")  # follows overrides of T
    return c
