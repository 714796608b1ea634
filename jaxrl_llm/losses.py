"""Per-token policy losses, KL estimators, entropy and loss aggregation modes.

Losses are element-wise ([..., T], to be minimised); reducing them is a separate,
named choice (`aggregate`) that returns `(total, denominator)` so micro-batches and
devices combine exactly: loss = sum(totals) / sum(denominators).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import check_array, check_choice

RATIO_LEVELS = ("token", "sequence")
AGGREGATION_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
KL_KINDS = ("k1", "k2", "k3")
_LOG_RATIO_CLAMP = 20.0
_K3_MAX = 10.0


def _check_token_args(logp, old_logp, advantages, mask):
    check_array("logp", logp, kind="float", layout="[..., T]")
    if logp.ndim < 1:
        raise ValueError(f"logp: expected [..., T] with rank >= 1, got shape {logp.shape}")
    check_array("old_logp", old_logp, shape=logp.shape, kind="float", layout="[..., T]")
    check_array("mask", mask, shape=logp.shape, kind="bool_or_float", layout="[..., T]")
    check_array("advantages", advantages, kind="float", layout="[...] or [..., T]")
    if advantages.shape == logp.shape[:-1]:
        return advantages[..., None]
    if advantages.shape != logp.shape:
        raise ValueError(
            f"advantages: expected shape {logp.shape[:-1]} or {logp.shape}, got {advantages.shape}"
        )
    return advantages


def policy_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio: str = "token",
    return_aux: bool = False,
):
    r"""Clipped surrogate policy loss per token (PPO / GRPO / DAPO / GSPO), to minimise.

    PPO ("Proximal Policy Optimization Algorithms"):

    .. math::
       L_t = \max\big(-A_t r_t,\; -A_t\,\mathrm{clip}(r_t, 1-\epsilon_{lo}, 1+\epsilon_{hi})\big),
       \quad r_t = \exp(\mathrm{clip}(\log\pi_\theta - \log\pi_{old}, -20, 20)).

    - :math:`\epsilon_{hi} > \epsilon_{lo}` is DAPO's clip-higher ("DAPO: An Open-Source
      LLM Reinforcement Learning System at Scale").
    - `dual_clip=c` (c > 1), dual-clip PPO ("Mastering Complex Control in MOBA Games
      with Deep Reinforcement Learning"): for :math:`A_t < 0`,
      :math:`L_t = \min(L_t, -A_t c)`.
    - `ratio="sequence"` is GSPO ("Group Sequence Policy Optimization"): every token
      uses the sequence ratio :math:`s_i = \exp(\frac{1}{|y_i|}\sum_t m_t
      (\log\pi_\theta - \log\pi_{old}))` as its value, with gradients flowing per token
      (:math:`\log \hat s_t = \log\pi_t - \mathrm{sg}(\log\pi_t) + \mathrm{sg}(\log s_i)`).

    Args:
      logp: float[..., T] log-probs of the taken tokens under the current policy.
      old_logp: float[..., T] the same under the sampling policy.
      advantages: float[...] (one per sequence) or float[..., T].
      mask: bool or float[..., T]; positions with mask 0 get loss 0 and are ignored
        by the sequence ratio.
      clip_low, clip_high: :math:`\epsilon_{lo}, \epsilon_{hi} \ge 0`.
      dual_clip: c > 1, or None.
      ratio: "token" or "sequence".

      return_aux: also return per-token diagnostics (see Returns).

    Returns:
      float[..., T] per-token loss (0 where masked); reduce it with `aggregate`. With
      `return_aux`, `(loss, aux)` where aux holds float[..., T] arrays, 0 where the mask
      is 0: "ratio" (the importance ratio used), "clipped_high" (A > 0 and
      r > 1 + clip_high: the clip is active), "clipped_low" (A < 0 and r < 1 - clip_low)
      and "dual_clipped" (the dual-clip bound is active).
    """
    check_choice("ratio", ratio, RATIO_LEVELS)
    for name, value in (("clip_low", clip_low), ("clip_high", clip_high)):
        if not value >= 0:
            raise ValueError(f"{name}: expected >= 0, got {value!r}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip: expected a value > 1 (or None), got {dual_clip!r}")
    adv = _check_token_args(logp, old_logp, advantages, mask)
    valid = mask > 0
    log_ratio = jnp.where(valid, logp - old_logp, 0.0)
    if ratio == "sequence":
        # GSPO: the value is the length-normalised sequence log-ratio, the gradient
        # flows per token through logp: logp - sg(logp) + sg(log s).
        count = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1)
        seq = jnp.sum(log_ratio, axis=-1, keepdims=True) / count
        log_ratio = logp - jax.lax.stop_gradient(logp) + jax.lax.stop_gradient(seq)
    r = jnp.exp(jnp.clip(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    unclipped = -adv * r
    clipped = -adv * jnp.clip(r, 1.0 - clip_low, 1.0 + clip_high)
    loss = jnp.maximum(unclipped, clipped)
    dual_active = jnp.zeros_like(loss, dtype=bool)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_active = (adv < 0) & (loss > bound)
        loss = jnp.where(adv < 0, jnp.minimum(loss, bound), loss)
    weight = valid.astype(loss.dtype)
    aux = {
        "ratio": r * weight,
        "clipped_high": ((adv > 0) & (r > 1.0 + clip_high)) * weight,
        "clipped_low": ((adv < 0) & (r < 1.0 - clip_low)) * weight,
        "dual_clipped": dual_active * weight,
    }
    loss = jnp.where(valid, loss, 0.0)
    return (loss, aux) if return_aux else loss


#: `policy_loss` with `return_aux=True`: returns `(loss, aux)`.
policy_loss_with_aux = functools.partial(policy_loss, return_aux=True)


def aggregate(per_token, mask, mode: str, *, max_len: int | None = None):
    r"""Reduces a per-token loss to `(total, denominator)`; the loss is their quotient.

    With :math:`m` the token mask and :math:`\mathcal{S}` the sequences with at least
    one valid token:

    - "token-mean" (DAPO): :math:`(\sum_{i,t} L m,\ \sum_{i,t} m)`.
    - "seq-mean-token-mean" (GRPO, "DeepSeekMath"):
      :math:`(\sum_{i\in\mathcal S} \frac{\sum_t L m}{\sum_t m},\ |\mathcal S|)`.
    - "seq-mean-token-sum": :math:`(\sum_{i,t} L m,\ |\mathcal S|)`.
    - "seq-mean-token-sum-norm" (Dr.GRPO, "Understanding R1-Zero-Like Training: A
      Critical Perspective"): :math:`(\sum_{i,t} L m,\ |\mathcal S| \cdot L_{\max})`,
      a denominator that does not depend on response lengths; `max_len` defaults to T.

    Both the total and the denominator are sums over sequences, so summing them over
    micro-batches or devices before dividing gives exactly the full-batch loss in every
    mode (a mean of per-micro-batch means would not).

    Args:
      per_token: float[..., T].
      mask: bool or float[..., T] (float = per-token weights).
      mode: one of AGGREGATION_MODES.
      max_len: the constant length for "seq-mean-token-sum-norm".

    Returns:
      (total, denominator): float32 scalars.
    """
    check_choice("mode", mode, AGGREGATION_MODES)
    check_array("per_token", per_token, kind="float", layout="[..., T]")
    check_array("mask", mask, shape=per_token.shape, kind="bool_or_float", layout="[..., T]")
    w = mask.astype(jnp.float32)
    weighted = jnp.where(w != 0, per_token.astype(jnp.float32) * w, 0.0)
    tokens = jnp.sum(w, axis=-1)  # [...]
    nonempty = jnp.sum(tokens > 0).astype(jnp.float32)
    if mode == "token-mean":
        return jnp.sum(weighted), jnp.sum(w)
    if mode == "seq-mean-token-mean":
        per_seq = jnp.sum(weighted, axis=-1) / jnp.where(tokens > 0, tokens, 1.0)
        return jnp.sum(per_seq), nonempty
    if mode == "seq-mean-token-sum":
        return jnp.sum(weighted), nonempty
    length = per_token.shape[-1] if max_len is None else max_len
    if length <= 0:
        raise ValueError(f"max_len: expected > 0, got {length!r}")
    return jnp.sum(weighted), nonempty * length


def kl_penalty(logp, ref_logp, kind: str):
    r"""Per-token estimators of :math:`\mathrm{KL}(\pi_\theta \| \pi_{ref})` on samples of
    :math:`\pi_\theta` (Schulman, "Approximating KL Divergence").

    With :math:`d = \log\pi_\theta - \log\pi_{ref}`:

    - "k1": :math:`d` (unbiased, high variance, can be negative);
    - "k2": :math:`\tfrac12 d^2`;
    - "k3": :math:`e^{x} - x - 1`, :math:`x = \mathrm{clip}(-d, -20, 20)`, result
      clipped to at most 10 (unbiased, non-negative; GRPO's estimator in "DeepSeekMath").

    Args:
      logp, ref_logp: float[..., T].
      kind: "k1", "k2" or "k3".

    Returns:
      float[..., T].
    """
    check_choice("kind", kind, KL_KINDS)
    check_array("logp", logp, kind="float")
    check_array("ref_logp", ref_logp, shape=logp.shape, kind="float")
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * jnp.square(d)
    x = jnp.clip(-d, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return jnp.minimum(jnp.exp(x) - x - 1.0, _K3_MAX)


def entropy(logits, temperature: float = 1.0):
    r"""Entropy of :math:`\mathrm{softmax}(z)`, :math:`z = \mathrm{logits}/\tau`, per position.

    :math:`H = \log\sum_v e^{z_v} - \sum_v \mathrm{softmax}(z)_v z_v`, computed in
    float32; -inf logits (a filtered vocabulary) contribute 0.

    Args:
      logits: float[..., V].
      temperature: :math:`\tau > 0`.

    Returns:
      float32[...].
    """
    check_array("logits", logits, kind="float", layout="[..., V]")
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature!r}")
    z = logits.astype(jnp.float32) / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    # -inf logits (filtered vocabulary) have probability 0; 0 * -inf would be NaN.
    finite_z = jnp.where(jnp.isfinite(z), z, 0.0)
    return lse - jnp.sum(jax.nn.softmax(z, axis=-1) * finite_z, axis=-1)
