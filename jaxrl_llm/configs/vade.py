"""VADE prompt selection on a mixed-difficulty task: arithmetic levels 1, 3 and 6 interleaved
(one- and two-digit addition, + - * with small operands, three-digit addition).

From the level-1 warm start, most groups of the harder levels are all wrong and many of
level 1 are all right: under uniform sampling their advantages are zero and their rollouts
are wasted. VADE (jaxrl_llm.data.vade) picks, of 4P candidates, the P prompts whose posterior
draws are most likely to give a mixed group. Its per-prompt statistics need prompts that
recur, so the run trains on a fixed set of 1536 prompts (512 per level), each drawn as a
candidate every three steps. The baseline is this file with `--config.data.sampler=uniform`;
the README compares the two.
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.data.source = "arithmetic/mixed"
    c.data.train_prompts = 1536
    c.data.sampler = "vade"
    return c
