"""DAPO: clip-higher, token-mean loss, dynamic sampling and soft overlong punishment."""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    t = c.sampling.get_ref("max_new_tokens")  # derived fields follow overrides of T
    c.rewards.names = ("correct", "overlong")
    c.rewards.kwargs.overlong = {"max_len": t, "buffer": t // 2}
    c.rl.transforms = (
        ("combine_rewards", {"weights": (1.0, 1.0)}),
        ("group_advantages", {"kind": "grpo"}),
        ("drop_uninformative_groups", {}),
    )
    c.rl.dynamic_sampling_rounds = 3
    c.loss.clip_low = 0.2
    c.loss.clip_high = 0.28
    c.loss.aggregation = "token-mean"
    return c
