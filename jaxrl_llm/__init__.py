"""jaxrl_llm: JAX-native, functional reinforcement learning for language models.

The algorithm library is re-exported here; the modules hold the array functions
(`advantages`, `downsample`, `losses`) and their (init, apply) transforms (`transforms`).
"""

from jaxrl_llm import advantages, downsample, losses, transforms
from jaxrl_llm.losses import aggregate, entropy, kl_penalty, policy_loss, policy_loss_with_aux
from jaxrl_llm.transforms import (
    RolloutTransform,
    chain,
    combine_rewards,
    drop_uninformative_groups,
    group_advantages,
    keep_max_variance_rollouts,
    keep_top_tokens,
    kl_in_reward,
    mask_truncated,
    shape_overlong,
)
from jaxrl_llm.types import Rollouts

__version__ = "0.1.0"

__all__ = [
    "RolloutTransform",
    "Rollouts",
    "advantages",
    "aggregate",
    "chain",
    "combine_rewards",
    "downsample",
    "drop_uninformative_groups",
    "entropy",
    "group_advantages",
    "keep_max_variance_rollouts",
    "keep_top_tokens",
    "kl_in_reward",
    "kl_penalty",
    "losses",
    "mask_truncated",
    "policy_loss",
    "policy_loss_with_aux",
    "shape_overlong",
    "transforms",
]
