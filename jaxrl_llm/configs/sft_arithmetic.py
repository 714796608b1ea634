"""Supervised warm start of the quickstart's base policy on 1-2 digit addition.

    python -m jaxrl_llm.sft --config configs/sft_arithmetic.py \
        --output jaxrl_llm/assets/base_arithmetic.safetensors

The demonstrations are noisy: 60% of the additions that need a carry are written with
the carry forgotten, so the base policy often prefers a systematically wrong answer while
still sampling the right one; the quickstart's RL run fixes that with the verifier.
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()  # the quickstart's model and task
    c.init.checkpoint = ""  # random init
    c.sft.steps = 2400
    c.sft.carry_error_rate = 0.6
    return c
