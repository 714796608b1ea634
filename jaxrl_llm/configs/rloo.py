"""RLOO: leave-one-out baseline ("Back to Basics: Revisiting REINFORCE Style Optimization")."""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.rl.transforms = (("group_advantages", {"kind": "rloo"}),)
    return c
