"""Group-relative advantage estimators and reward shaping, as pure functions over arrays.

Layout: `rewards` is float[P, G] (P prompts, G rollouts each) or float[P, G, K] with K
reward functions; `valid` is bool[P, G]. Invalid members never influence valid ones and
get advantage 0. "std" is the unbiased (ddof=1) standard deviation over the valid
members of a group, with `eps` added outside the square root.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_llm._checks import check_array, check_choice, default_valid

GRPO_SCALES = ("group", "batch", "none")
MEDIAN_SCALES = ("mad", "none")


def _rewards_2d(rewards, valid):
    check_array("rewards", rewards, rank=2, kind="float", layout="[P, G]")
    valid = default_valid(valid, rewards.shape)
    # Zeroing invalid entries first keeps NaN/inf padding out of every reduction.
    return jnp.where(valid, rewards, 0.0), valid


def _masked_moments(x, valid, axis=-1):
    """(n, mean, unbiased std) over the valid entries along `axis` (two-pass, stable)."""
    n = jnp.sum(valid, axis=axis, keepdims=True)
    mean = jnp.sum(jnp.where(valid, x, 0.0), axis=axis, keepdims=True) / jnp.maximum(n, 1)
    sq = jnp.where(valid, jnp.square(x - mean), 0.0)
    var = jnp.sum(sq, axis=axis, keepdims=True) / jnp.maximum(n - 1, 1)
    return n, mean, jnp.sqrt(var)


def _lower_median(x, valid):
    """Per row of [P, G]: the lower median of the valid entries ([P, 1]); 0 if none."""
    n = jnp.sum(valid, axis=-1, keepdims=True)
    ordered = jnp.sort(jnp.where(valid, x, jnp.inf), axis=-1)
    # For an even count the lower of the two middle values: index (n - 1) // 2.
    mid = jnp.take_along_axis(ordered, jnp.maximum((n - 1) // 2, 0), axis=-1)
    return jnp.where(n > 0, mid, 0.0)


def grpo(rewards, valid=None, *, scale: str = "group", eps: float = 1e-6):
    r"""Group-relative advantages of GRPO and Dr.GRPO.

    GRPO ("DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
    Models"): :math:`A_{pg} = (r_{pg} - \mu_p) / (\sigma_p + \epsilon)` with
    :math:`\mu_p, \sigma_p` the mean and unbiased std of group p's valid rewards.
    `scale="batch"` uses the std of all valid rewards of the batch instead (mean stays
    per group; "Tricks or Traps? A Deep Dive into RL for LLM Reasoning").
    `scale="none"` is Dr.GRPO ("Understanding R1-Zero-Like Training: A Critical
    Perspective"): :math:`A_{pg} = r_{pg} - \mu_p`.

    Groups with fewer than 2 valid members carry no comparison and get 0.

    Args:
      rewards: float[P, G].
      valid: bool[P, G] or None (all valid).
      scale: "group", "batch" or "none".
      eps: added to the std, outside the square root.

    Returns:
      float[P, G] advantages, 0 where invalid.
    """
    check_choice("scale", scale, GRPO_SCALES)
    r, valid = _rewards_2d(rewards, valid)
    n, mean, std = _masked_moments(r, valid)
    if scale == "group":
        adv = (r - mean) / (std + eps)
    elif scale == "batch":
        _, _, batch_std = _masked_moments(r.reshape(-1), valid.reshape(-1))  # over P * G
        adv = (r - mean) / (batch_std + eps)
    else:
        adv = r - mean
    return jnp.where(valid & (n >= 2), adv, 0.0)


def rloo(rewards, valid=None):
    r"""REINFORCE leave-one-out advantages.

    "Buy 4 REINFORCE Samples, Get a Baseline for Free!" and "Back to Basics: Revisiting
    REINFORCE Style Optimization for Learning from Human Feedback in LLMs":
    :math:`A_{pg} = r_{pg} - \frac{1}{n_p - 1}\sum_{j \ne g} r_{pj}
    = \frac{n_p r_{pg} - \sum_j r_{pj}}{n_p - 1}` over the valid members of group p.

    Args:
      rewards: float[P, G].
      valid: bool[P, G] or None.

    Returns:
      float[P, G]; 0 where invalid and for groups with fewer than 2 valid members.
    """
    r, valid = _rewards_2d(rewards, valid)
    n = jnp.sum(valid, axis=-1, keepdims=True)
    total = jnp.sum(r, axis=-1, keepdims=True)
    adv = (n * r - total) / jnp.maximum(n - 1, 1)
    return jnp.where(valid & (n >= 2), adv, 0.0)


def median_centered(
    rewards, valid=None, *, scale: str = "mad", eps: float = 1e-3, compensate_zeros: bool = False
):
    r"""Median-centred advantages and the pivot to drop, from MC-GRPO.

    "MC-GRPO: Median-Centered Group Relative Policy Optimization for Small-Rollout
    Reinforcement Learning". With :math:`m_p` the lower median of group p's valid
    rewards and :math:`\mathrm{MAD}_p = \mathrm{median}_g |r_{pg} - m_p|` (lower median):

    - `scale="mad"`:  :math:`A_{pg} = (r_{pg} - m_p) / (\mathrm{MAD}_p + \epsilon)`
    - `scale="none"`: :math:`A_{pg} = r_{pg} - m_p`

    The median is a sampled reward, so one member per group (the pivot) has advantage 0
    by construction; sampling G + 1 rollouts and excluding the pivot from the loss gives
    G informative rollouts per update. Note that with binary rewards the MAD is often 0,
    so `"mad"` then scales by :math:`1/\epsilon`; use `"none"` for 0/1 rewards.

    `compensate_zeros=True` multiplies each group's non-zero advantages by
    :math:`n_p / n^{\ne 0}_p` (valid members over members with a non-zero advantage), so
    the group's total update size does not shrink when ties with the median zero some out.

    Args:
      rewards: float[P, G] (G is the sampled count, e.g. G' + 1).
      valid: bool[P, G] or None.
      scale: "mad" or "none".
      eps: added to the MAD.
      compensate_zeros: see above.

    Returns:
      (advantages float[P, G], pivot bool[P, G]). `pivot` marks exactly one valid member
      per group with at least one valid member: the lowest index holding the median.
    """
    check_choice("scale", scale, MEDIAN_SCALES)
    r, valid = _rewards_2d(rewards, valid)
    med = _lower_median(r, valid)  # [P, 1]
    centred = r - med
    if scale == "mad":
        mad = _lower_median(jnp.abs(centred), valid)
        centred = centred / (mad + eps)
    adv = jnp.where(valid, centred, 0.0)
    if compensate_zeros:
        n = jnp.sum(valid, axis=-1, keepdims=True)
        nonzero = jnp.sum(adv != 0, axis=-1, keepdims=True)
        adv = adv * (n / jnp.maximum(nonzero, 1))
    at_median = valid & (r == med)
    first = jnp.argmax(at_median, axis=-1)  # lowest index among the ties
    pivot = (jnp.arange(r.shape[-1]) == first[:, None]) & jnp.any(at_median, -1, keepdims=True)
    return adv, pivot


def combine_rewards(rewards, weights):
    r"""Weighted sum of K reward functions: :math:`r_{pg} = \sum_k w_k r_{pgk}`.

    What GRPO does with several rewards (TRL's "sum_then_normalize").

    Args:
      rewards: float[P, G, K].
      weights: float[K] (or a length-K sequence).

    Returns:
      float[P, G].
    """
    check_array("rewards", rewards, rank=3, kind="float", layout="[P, G, K]")
    weights = jnp.asarray(weights, dtype=rewards.dtype)
    check_array("weights", weights, shape=(rewards.shape[-1],), layout="[K]")
    return jnp.einsum("pgk,k->pg", rewards, weights)


def gdpo(rewards, weights, valid=None, *, eps: float = 1e-4):
    r"""Decoupled multi-reward normalization of GDPO.

    "GDPO: Group reward-Decoupled Normalization Policy Optimization" (NVIDIA). Each
    reward is normalized within its group first, so a reward with a large scale or
    variance cannot drown the others:

    .. math::
       \hat r_{pgk} = \frac{r_{pgk} - \mu_{pk}}{\sigma_{pk} + \epsilon},\quad
       x_{pg} = \sum_k w_k \hat r_{pgk},\quad
       A_{pg} = \frac{x_{pg} - \mu_x}{\sigma_x + \epsilon}

    with group statistics over the group's valid members and :math:`\mu_x, \sigma_x`
    over all valid rollouts of the batch. Members of groups with fewer than 2 valid
    members have :math:`\hat r = 0` and get advantage 0.

    Args:
      rewards: float[P, G, K].
      weights: float[K].
      valid: bool[P, G] or None.
      eps: added to both stds.

    Returns:
      float[P, G].
    """
    check_array("rewards", rewards, rank=3, kind="float", layout="[P, G, K]")
    valid = default_valid(valid, rewards.shape)
    weights = jnp.asarray(weights, dtype=rewards.dtype)
    check_array("weights", weights, shape=(rewards.shape[-1],), layout="[K]")
    valid_k = valid[..., None]  # [P, G, 1]
    r = jnp.where(valid_k, rewards, 0.0)
    n, mean, std = _masked_moments(r, jnp.broadcast_to(valid_k, r.shape), axis=1)  # [P, 1, K]
    per_reward = jnp.where(valid_k & (n >= 2), (r - mean) / (std + eps), 0.0)
    x = jnp.einsum("pgk,k->pg", per_reward, weights)
    _, batch_mean, batch_std = _masked_moments(x.reshape(-1), valid.reshape(-1))
    adv = (x - batch_mean) / (batch_std + eps)
    return jnp.where(valid & (n[..., 0] >= 2), adv, 0.0)


def ngrpo(rewards, valid=None, *, max_reward: float = 1.0, eps: float = 1e-6):
    r"""NGRPO advantage calibration with a virtual maximum-reward member.

    "NGRPO: Negative-enhanced Group Relative Policy Optimization". The group statistics
    are computed as if one more member with reward :math:`r_{\max}` were present, so a
    group whose samples are all wrong still gets a (negative) learning signal:

    .. math::
       \tilde\mu_p = \frac{\sum_g r_{pg} + r_{\max}}{n_p + 1},\quad
       \tilde\sigma_p^2 = \frac{\sum_g (r_{pg}-\tilde\mu_p)^2 + (r_{\max}-\tilde\mu_p)^2}{n_p},
       \quad A_{pg} = \frac{r_{pg} - \tilde\mu_p}{\tilde\sigma_p + \epsilon}

    Args:
      rewards: float[P, G].
      valid: bool[P, G] or None.
      max_reward: the virtual member's reward (the best achievable reward).
      eps: added to the std.

    Returns:
      float[P, G]; 0 where invalid. A group of all-max rewards gets 0.
    """
    r, valid = _rewards_2d(rewards, valid)
    n = jnp.sum(valid, axis=-1, keepdims=True)
    mean = (jnp.sum(r, axis=-1, keepdims=True) + max_reward) / (n + 1)
    sq = jnp.sum(jnp.where(valid, jnp.square(r - mean), 0.0), axis=-1, keepdims=True)
    std = jnp.sqrt((sq + jnp.square(max_reward - mean)) / jnp.maximum(n, 1))
    return jnp.where(valid, (r - mean) / (std + eps), 0.0)


def weighted_reinforce(
    rewards, valid=None, *, positive_weight: float = 0.1, threshold: float = 0.5
):
    r"""W-REINFORCE: down-weighted positive, full negative reinforcement.

    "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning":
    :math:`A_{pg} = \lambda` if :math:`r_{pg} > \tau` else :math:`-1`, with
    :math:`\lambda` = `positive_weight` and :math:`\tau` = `threshold`.

    Args:
      rewards: float[P, G].
      valid: bool[P, G] or None.

    Returns:
      float[P, G]; 0 where invalid.
    """
    r, valid = _rewards_2d(rewards, valid)
    return jnp.where(valid, jnp.where(r > threshold, positive_weight, -1.0), 0.0)


def overlong_penalty(lengths, *, max_len: int, buffer: int, factor: float = 1.0):
    r"""DAPO's soft overlong punishment, added to the reward of long responses.

    "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (eq. 13): with
    :math:`L_{\max}` = `max_len` and :math:`L_{\mathrm{cache}}` = `buffer`,

    .. math::
       R(y) = \begin{cases} 0 & |y| \le L_{\max} - L_{\mathrm{cache}} \\
       \frac{(L_{\max} - L_{\mathrm{cache}}) - |y|}{L_{\mathrm{cache}}} \cdot f
       & L_{\max} - L_{\mathrm{cache}} < |y| \le L_{\max} \\ -f & |y| > L_{\max}
       \end{cases}

    Args:
      lengths: int or float array of response lengths in tokens, any shape.
      max_len: :math:`L_{\max}`.
      buffer: :math:`L_{\mathrm{cache}}`, 0 < buffer <= max_len.
      factor: the penalty at and beyond :math:`L_{\max}` (DAPO uses 1).

    Returns:
      float array shaped like `lengths`, in [-factor, 0].
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"buffer: expected 0 < buffer <= max_len ({max_len}), got {buffer}")
    over = jnp.asarray(lengths, jnp.float32) - (max_len - buffer)
    return jnp.clip(-over / buffer * factor, -factor, 0.0)


def _kl_inputs(kl, mask, valid):
    check_array("kl", kl, rank=3, kind="float", layout="[P, G, T]")
    check_array("mask", mask, shape=kl.shape, kind="bool_or_float", layout="[P, G, T]")
    valid = default_valid(valid, kl.shape)
    mask = mask.astype(jnp.float32)
    # Masked positions may hold anything (padding logits): where() keeps NaN/inf out.
    return jnp.where(mask > 0, kl * mask, 0.0), mask, valid


def kl_in_reward(scores, kl, mask, beta, valid=None):
    r"""Subtracts a per-sequence KL penalty from the scalar rewards (KL in the reward).

    The reward of RLHF with a KL penalty, "Fine-Tuning Language Models from Human
    Preferences" (Ziegler et al.) and InstructGPT ("Training language models to follow
    instructions with human feedback"): :math:`R(x, y) = r(x, y) - \beta\,\mathrm{KL}`,
    estimated per token on the sampled response (verl's `algorithm.use_kl_in_reward`).
    verl puts the scalar score on the last response token and subtracts
    :math:`\beta\,k_t` on every token; an outcome estimator (GRPO, RLOO, ...) then sums
    the token rewards, so that for member (p, g)

    .. math::
       s'_{pg} = s_{pg} - \beta \sum_t m_{pgt}\, k_{pgt}

    with :math:`k_{pgt}` a per-token KL estimate of the sampling (old) policy to the
    reference (`losses.kl_penalty(old_logp, ref_logp, kind)`) and :math:`m` the mask.

    Args:
      scores: float[P, G] scalar rewards.
      kl: float[P, G, T] per-token KL estimates; masked positions are ignored (even NaN).
      mask: bool or float[P, G, T] completion mask (float = per-token weights).
      beta: the KL coefficient, a Python or traced scalar.
      valid: bool[P, G] or None (all valid); invalid members keep their score.

    Returns:
      (new scores float[P, G], seq_kl float[P, G] = :math:`\sum_t m_{pgt} k_{pgt}`, 0
      where invalid).
    """
    check_array("scores", scores, rank=2, kind="float", layout="[P, G]")
    check_array("kl", kl, shape=(*scores.shape, None), layout="[P, G, T]")
    kl, _, valid = _kl_inputs(kl, mask, valid)
    seq_kl = jnp.where(valid, jnp.sum(kl, axis=-1), 0.0)
    return scores - beta * seq_kl, seq_kl


def mean_sequence_kl(kl, mask, valid=None):
    r"""The batch KL an adaptive KL controller tracks: the mean per-sequence mean KL.

    :math:`\overline{\mathrm{KL}} = \frac{1}{|V|}\sum_{(p,g) \in V}
    \frac{\sum_t m_{pgt} k_{pgt}}{\sum_t m_{pgt}}` over the valid members V (verl's
    `apply_kl_penalty`: `masked_mean(kld, mask, axis=-1)`, then the mean over the batch).
    A member with an empty mask contributes 0 (as in verl); 0 if no member is valid.

    Args:
      kl: float[P, G, T] per-token KL estimates.
      mask: bool or float[P, G, T].
      valid: bool[P, G] or None (all valid).

    Returns:
      float32[] scalar.
    """
    kl, mask, valid = _kl_inputs(kl, mask, valid)
    per_seq = jnp.sum(kl, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1e-8)
    n = jnp.sum(valid)
    return jnp.sum(jnp.where(valid, per_seq, 0.0)) / jnp.maximum(n, 1)


def adaptive_kl_beta(beta, current_kl, target: float, horizon: float, n_steps):
    r"""One update of the adaptive KL coefficient (a proportional controller).

    "Fine-Tuning Language Models from Human Preferences" (Ziegler et al., 2019, §2.2),
    as in verl's `AdaptiveKLController.update`:

    .. math::
       e = \mathrm{clip}\left(\frac{\mathrm{KL}}{\mathrm{KL}_{\mathrm{target}}} - 1,
       -0.2, 0.2\right),\quad \beta \leftarrow \beta\,\left(1 + e\,\frac{n}{H}\right)

    with n the number of samples (sequences) behind this KL estimate and H the horizon.

    Args:
      beta: the current coefficient, scalar.
      current_kl: the measured KL (e.g. `mean_sequence_kl`), scalar.
      target: :math:`\mathrm{KL}_{\mathrm{target}} > 0`.
      horizon: :math:`H > 0`.
      n_steps: n, scalar (verl passes the batch size in sequences).

    Returns:
      float32[] the new coefficient.
    """
    if not target > 0:
        raise ValueError(f"target: expected a positive KL target, got {target!r}")
    if not horizon > 0:
        raise ValueError(f"horizon: expected a positive horizon, got {horizon!r}")
    err = jnp.clip(jnp.asarray(current_kl, jnp.float32) / target - 1.0, -0.2, 0.2)
    return jnp.asarray(beta, jnp.float32) * (
        1.0 + err * jnp.asarray(n_steps, jnp.float32) / horizon
    )
