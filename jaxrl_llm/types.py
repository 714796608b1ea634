"""Pytrees that cross a stage boundary, with the shape of every field.

P prompts, G rollouts per prompt, K reward functions, T completion tokens.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from jaxrl_llm._checks import check_array


@struct.dataclass
class Rollouts:
    """Scored rollouts flowing through the transform chain (see `transforms.py`).

    A member (p, g) is *active* when it is valid and its sample weight is positive;
    estimators and selections look only at active members, so transforms compose.
    """

    rewards: jnp.ndarray  # float32[P, G, K] one column per reward function
    valid: jnp.ndarray  # bool[P, G] False for padding / failed rollouts (NaN reward)
    scores: jnp.ndarray  # float32[P, G] the scalar reward the estimator sees
    advantages: jnp.ndarray  # float32[P, G]
    sample_weight: jnp.ndarray  # float32[P, G] 0 = excluded from the loss
    token_weight: jnp.ndarray | None = None  # float32[P, G, T] completion mask / weights
    entropy: jnp.ndarray | None = None  # float32[P, G, T] per-token policy entropy
    lengths: jnp.ndarray | None = None  # int32[P, G] completion lengths in tokens
    truncated: jnp.ndarray | None = None  # bool[P, G] hit the length limit without EOS
    kl: jnp.ndarray | None = None  # float32[P, G, T] per-token KL of the old policy to the ref

    @classmethod
    def create(
        cls,
        rewards,
        *,
        valid=None,
        token_mask=None,
        entropy=None,
        lengths=None,
        truncated=None,
        kl=None,
    ) -> Rollouts:
        """Builds Rollouts from raw rewards.

        Args:
          rewards: float[P, G] or float[P, G, K]. NaN marks a failed reward: that
            member becomes invalid (its reward is kept as 0).
          valid: bool[P, G] or None (all valid).
          token_mask: bool/float[P, G, T] or None.
          entropy: float[P, G, T] or None.
          lengths: int[P, G] or None.
          truncated: bool[P, G] or None.
          kl: float[P, G, T] or None: per-token KL estimate of the sampling (old) policy
            to the reference, e.g. `losses.kl_penalty(old_logp, ref_logp, kind)`.

        `scores` starts as the plain sum over K (use `combine_rewards` to weight or
        decouple); `advantages` start at 0 and `sample_weight` at `valid`.
        """
        check_array("rewards", rewards, kind="float", layout="[P, G] or [P, G, K]")
        if rewards.ndim == 2:
            rewards = rewards[..., None]
        check_array("rewards", rewards, rank=3, layout="[P, G] or [P, G, K]")
        pg = rewards.shape[:2]
        rewards = rewards.astype(jnp.float32)
        finite = jnp.all(~jnp.isnan(rewards), axis=-1)
        if valid is None:
            valid = finite
        else:
            check_array("valid", valid, shape=pg, kind="bool", layout="[P, G]")
            valid = valid & finite
        rewards = jnp.where(valid[..., None], rewards, 0.0)
        if token_mask is not None:
            check_array("token_mask", token_mask, rank=3, kind="bool_or_float")
            check_array("token_mask", token_mask, shape=(*pg, None), layout="[P, G, T]")
            token_mask = token_mask.astype(jnp.float32)
        if entropy is not None:
            want = (*pg, None) if token_mask is None else token_mask.shape
            check_array("entropy", entropy, shape=want, kind="float", layout="[P, G, T]")
        if kl is not None:
            want = (*pg, None) if token_mask is None else token_mask.shape
            check_array("kl", kl, shape=want, kind="float", layout="[P, G, T]")
        if lengths is not None:
            check_array("lengths", lengths, shape=pg, kind="int", layout="[P, G]")
        if truncated is not None:
            check_array("truncated", truncated, shape=pg, kind="bool", layout="[P, G]")
        return cls(
            rewards=rewards,
            valid=valid,
            scores=jnp.sum(rewards, axis=-1),
            advantages=jnp.zeros(pg, jnp.float32),
            sample_weight=valid.astype(jnp.float32),
            token_weight=token_mask,
            entropy=entropy,
            lengths=lengths,
            truncated=truncated,
            kl=kl,
        )

    @property
    def active(self):
        """bool[P, G]: valid members still in the loss."""
        return self.valid & (self.sample_weight > 0)

    def loss_weights(self):
        """float32[P, G, T]: the per-token weight of the loss (sample x token weights)."""
        if self.token_weight is None:
            raise ValueError("token_weight: Rollouts were created without a token_mask")
        return self.token_weight * self.sample_weight[..., None]
