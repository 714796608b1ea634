"""MC-GRPO with G = 2 + 1: three samples per prompt, the median one is the pivot.

The pivot (advantage 0 by construction) is excluded from the loss, so each prompt
trains on 2 rollouts. Rewards are 0/1, where the MAD is usually 0: scale="none".
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.rl.group_size = 3
    c.rl.transforms = (("group_advantages", {"kind": "median", "scale": "none"}),)
    return c
