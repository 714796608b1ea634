"""GRPO ("DeepSeekMath"): group-normalized advantages, per-sequence token means, k3 KL."""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.rl.transforms = (("group_advantages", {"kind": "grpo"}),)
    c.loss.aggregation = "seq-mean-token-mean"
    c.loss.beta = 0.04
    c.loss.kl_kind = "k3"
    return c
