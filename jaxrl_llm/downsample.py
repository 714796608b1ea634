"""Selection of rollouts and tokens to train on: pure functions returning boolean masks.

Sample level: PODS's max-variance down-sampling ("Not All Rollouts are Useful:
Down-Sampling Rollouts in LLM Reinforcement Learning") and DAPO's dynamic-sampling
criterion. Token level and schedule: D3S ("Learning More with Less: A Dynamic
Dual-Level Down-Sampling Framework for Efficient Policy Optimization").
"""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp

from jaxrl_llm._checks import check_array, check_choice, default_valid

SCHEDULE_KINDS = ("linear", "cosine")


def max_variance_subset(rewards, k: int, valid=None):
    r"""Per group, the k valid members whose rewards have the largest variance.

    PODS ("Not All Rollouts are Useful: Down-Sampling Rollouts in LLM Reinforcement
    Learning"), used by D3S for sample-level selection:
    :math:`S_p = \arg\max_{|S|=k} \mathrm{Var}(\{r_{pg}\}_{g \in S})`. After sorting, an
    optimal subset is always the j lowest plus the k - j highest rewards for some j, so
    the k + 1 candidates are scored and the first best j is taken. Among members with
    equal rewards the lower index is kept first. Groups with fewer than k valid members
    keep all of them. Cost O(P (k + G) G).

    Args:
      rewards: float[P, G] (rewards, or any per-rollout score such as advantages).
      k: number of members to keep per group, 1 <= k <= G.
      valid: bool[P, G] or None.

    Returns:
      bool[P, G], a subset of `valid`.
    """
    check_array("rewards", rewards, rank=2, kind="float", layout="[P, G]")
    group_size = rewards.shape[1]
    if not isinstance(k, numbers.Integral) or not 1 <= k <= group_size:
        raise ValueError(f"k: expected an int in [1, G={group_size}], got {k!r}")
    valid = default_valid(valid, rewards.shape)
    r = jnp.where(valid, rewards, 0.0)
    n = jnp.sum(valid, axis=-1)  # [P]
    ordered = jnp.sort(jnp.where(valid, r, jnp.inf), axis=-1)  # valid first, ascending
    ordered = jnp.where(jnp.isfinite(ordered), ordered, 0.0)

    pos = jnp.arange(group_size)  # sorted position
    js = jnp.arange(k + 1)  # j lowest + (k - j) highest
    take = (pos[None, None, :] < js[None, :, None]) | (
        (pos[None, None, :] >= (n[:, None, None] - (k - js)[None, :, None]))
        & (pos[None, None, :] < n[:, None, None])
    )  # [P, k + 1, G]
    sel = jnp.where(take, ordered[:, None, :], 0.0)
    mean = jnp.sum(sel, -1, keepdims=True) / k
    var = jnp.sum(jnp.where(take, jnp.square(sel - mean), 0.0), -1)  # [P, k + 1]
    best = jnp.argmax(var, axis=-1)  # first maximum: the smallest j
    chosen = jnp.take_along_axis(take, best[:, None, None], axis=1)[:, 0, :]  # [P, G] sorted

    # Map the chosen sorted positions back to members: each value v is needed
    # need(v) times, and the members holding v are taken in index order.
    same = (r[:, :, None] == ordered[:, None, :]) & valid[:, :, None]  # member g ~ position s
    need = jnp.sum(same & chosen[:, None, :], axis=-1)  # [P, G]
    equal = (r[:, :, None] == r[:, None, :]) & valid[:, None, :]  # [P, g, h]
    earlier = pos[None, :] < pos[:, None]  # h < g
    rank = jnp.sum(equal & earlier[None], axis=-1)  # members with the same value before g
    keep = valid & (rank < need)
    return jnp.where((n >= k)[:, None], keep, valid)


def top_token_mask(scores, mask, fraction):
    r"""The top `fraction` of valid tokens of the whole batch by score.

    D3S's token-level selection ("Learning More with Less: A Dynamic Dual-Level
    Down-Sampling Framework for Efficient Policy Optimization") scores tokens by
    :math:`|A_t| \cdot H_t`. Keeps :math:`n = \mathrm{clip}(\lfloor f N + 1/2 \rfloor,
    1, N)` tokens, N the number of valid tokens (none if N = 0); ties go to the lower
    flat index, so the result is deterministic. NaN scores rank last.

    Args:
      scores: float[..., T].
      mask: bool or float[..., T] (non-zero = valid), same shape.
      fraction: f in (0, 1], a Python float or a traced scalar (e.g. a schedule).

    Returns:
      bool[..., T], a subset of the valid tokens.
    """
    check_array("scores", scores, kind="float", layout="[..., T]")
    check_array("mask", mask, shape=scores.shape, kind="bool_or_float", layout="[..., T]")
    if isinstance(fraction, numbers.Real) and not 0 < fraction <= 1:
        raise ValueError(f"fraction: expected a value in (0, 1], got {fraction!r}")
    flat_valid = mask.reshape(-1) > 0
    flat = scores.reshape(-1)
    flat = jnp.where(jnp.isnan(flat), -jnp.inf, flat)
    n_valid = jnp.sum(flat_valid)
    n_keep = jnp.clip(jnp.floor(fraction * n_valid + 0.5), 1, n_valid)
    index = jnp.arange(flat.shape[0])
    # lexsort: the last key is primary -> valid first, then score descending, then index.
    order = jnp.lexsort((index, -flat, ~flat_valid))
    rank = jnp.zeros_like(index).at[order].set(index)
    return (flat_valid & (rank < n_keep)).reshape(scores.shape)


def keep_fraction(step, *, start: float, end: float, steps: int, kind: str = "linear"):
    r"""D3S's down-sampling schedule: keep few tokens early, relax later.

    With :math:`u = \min(\mathrm{step} / \mathrm{steps}, 1)`:
    linear :math:`f = s + (e - s) u`; cosine :math:`f = e + (s - e)(1 + \cos \pi u) / 2`.
    From "Learning More with Less: A Dynamic Dual-Level Down-Sampling Framework for
    Efficient Policy Optimization" (aggressive down-sampling early, relaxed later).

    Args:
      step: int scalar (Python or traced).
      start, end: fractions in (0, 1].
      steps: length of the ramp, > 0.
      kind: "linear" or "cosine".

    Returns:
      float32 scalar fraction.
    """
    check_choice("kind", kind, SCHEDULE_KINDS)
    for name, value in (("start", start), ("end", end)):
        if not 0 < value <= 1:
            raise ValueError(f"{name}: expected a fraction in (0, 1], got {value!r}")
    if steps <= 0:
        raise ValueError(f"steps: expected > 0, got {steps!r}")
    u = jnp.minimum(jnp.asarray(step, jnp.float32) / steps, 1.0)
    if kind == "linear":
        return start + (end - start) * u
    return end + (start - end) * 0.5 * (1.0 + jnp.cos(math.pi * u))


def informative_groups(rewards, valid=None):
    r"""DAPO's dynamic-sampling criterion: groups whose valid rewards are not all equal.

    "DAPO: An Open-Source LLM Reinforcement Learning System at Scale": keep prompt p iff
    :math:`\mathrm{std}(\{r_{pg}\}_{g\,\mathrm{valid}}) > 0`, i.e. at least two valid members
    with different rewards (tested as max - min > 0, exact in floating point).

    Args:
      rewards: float[P, G].
      valid: bool[P, G] or None.

    Returns:
      bool[P].
    """
    check_array("rewards", rewards, rank=2, kind="float", layout="[P, G]")
    valid = default_valid(valid, rewards.shape)
    hi = jnp.max(jnp.where(valid, rewards, -jnp.inf), axis=-1)
    lo = jnp.min(jnp.where(valid, rewards, jnp.inf), axis=-1)
    return hi > lo  # False for fewer than 2 valid members (then hi <= lo)
