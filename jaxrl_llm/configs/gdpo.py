"""GDPO: correctness, format and length rewards normalized per group separately.

Decoupled normalization keeps the dense length reward from drowning the sparse
correctness reward; the batch-normalized result is the advantage.
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.rewards.names = ("correct", "format", "length")
    t = c.sampling.get_ref("max_new_tokens")  # derived fields follow overrides of T
    c.rewards.kwargs.length = {"target_len": t // 2, "max_len": t}
    c.rl.transforms = (
        ("combine_rewards", {"weights": (1.0, 0.5, 0.25), "decoupled": True}),
        ("group_advantages", {"kind": "identity"}),
    )
    return c
