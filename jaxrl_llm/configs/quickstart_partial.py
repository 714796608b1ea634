"""The quickstart with APRIL partial rollouts: 160 prompt groups requested per step, the first
128 complete ones trained, the rest continued first in the next step (decoupled PPO loss).

`python -m jaxrl_llm.train --config quickstart_partial`; the README compares it with the
quickstart (held-out accuracy and wall time).
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.sampling.update(engine="continuous", slots=0)  # 0: every requested row has a slot
    c.rl.partial_rollouts = 32  # extra groups beyond P = 128
    return c
