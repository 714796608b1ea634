"""The README's main job: GRPO on 1-2 digit addition from the shipped SFT base policy.

Runs in a few minutes on a 2-core CPU; held-out greedy accuracy rises from the base
policy's. `python -m jaxrl_llm.train --config quickstart` (from the checkout also
`--config configs/quickstart.py`).
"""

from jaxrl_llm.config import base_config


def get_config():
    return base_config()
