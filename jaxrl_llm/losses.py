"""Per-token policy losses, off-policy corrections, KL, entropy and aggregation modes.

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
IS_CAP_MODES = ("truncate", "mask")
_LOG_RATIO_CLAMP = 20.0
_K3_MAX = 10.0


def _check_token_args(logp, old_logp, advantages, mask, old_name="old_logp"):
    check_array("logp", logp, kind="float", layout="[..., T]")
    if logp.ndim < 1:
        raise ValueError(f"logp: expected [..., T] with rank >= 1, got shape {logp.shape}")
    check_array(old_name, old_logp, shape=logp.shape, kind="float", layout="[..., T]")
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
    _check_clip_args(clip_low, clip_high, dual_clip, ratio)
    adv = _check_token_args(logp, old_logp, advantages, mask)
    valid = mask > 0
    loss, aux = _clipped_surrogate(
        logp, old_logp, adv, valid, clip_low, clip_high, dual_clip, ratio
    )
    loss = jnp.where(valid, loss, 0.0)
    return (loss, aux) if return_aux else loss


def _check_clip_args(clip_low, clip_high, dual_clip, ratio):
    check_choice("ratio", ratio, RATIO_LEVELS)
    for name, value in (("clip_low", clip_low), ("clip_high", clip_high)):
        if not value >= 0:
            raise ValueError(f"{name}: expected >= 0, got {value!r}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip: expected a value > 1 (or None), got {dual_clip!r}")


def _clipped_surrogate(logp, old_logp, adv, valid, clip_low, clip_high, dual_clip, ratio):
    """The (dual-)clipped surrogate of `policy_loss`, unmasked, and its aux dict (masked)."""
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
    return loss, aux


#: `policy_loss` with `return_aux=True`: returns `(loss, aux)`.
policy_loss_with_aux = functools.partial(policy_loss, return_aux=True)


def _check_log_ratio_args(logp_target, logp_behav, mask, target_name, behav_name):
    check_array(target_name, logp_target, kind="float", layout="[..., T]")
    if logp_target.ndim < 1:
        raise ValueError(
            f"{target_name}: expected [..., T] with rank >= 1, got shape {logp_target.shape}"
        )
    check_array(behav_name, logp_behav, shape=logp_target.shape, kind="float", layout="[..., T]")
    check_array("mask", mask, shape=logp_target.shape, kind="bool_or_float", layout="[..., T]")


def _behaviour_weights(prox_logp, behav_logp, valid, cap, cap_mode):
    """Stop-gradient w = pi_prox / pi_behav, capped; returns (w, capped), both 0 where masked."""
    log_w = jnp.where(valid, prox_logp - behav_logp, 0.0)
    w = jax.lax.stop_gradient(jnp.exp(jnp.clip(log_w, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)))
    capped = jnp.zeros_like(valid) if cap is None else valid & (w > cap)
    if cap is not None:
        w = jnp.minimum(w, cap) if cap_mode == "truncate" else jnp.where(capped, 0.0, w)
    return jnp.where(valid, w, 0.0), capped


def _check_cap(name, cap, cap_mode):
    check_choice(f"{name}_mode", cap_mode, IS_CAP_MODES)
    if cap is not None and not cap > 0:
        raise ValueError(f"{name}: expected a value > 0 (or None), got {cap!r}")


def decoupled_policy_loss(
    logp,
    prox_logp,
    behav_logp,
    advantages,
    mask,
    *,
    weights=None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio: str = "token",
    is_cap: float | None = None,
    is_cap_mode: str = "truncate",
    return_aux: bool = False,
):
    r"""Decoupled PPO loss per token: clip against a proximal policy, reweight the behaviour one.

    "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
    Reasoning" (Fu et al., 2025), after "Batch size-invariance for policy optimization"
    (Hilton et al., 2022). Tokens come from a behaviour policy :math:`\pi_{behav}` (possibly
    several stale versions within one sequence, as with partial rollouts); the trust region
    is centred on a recent proximal policy :math:`\pi_{prox}` (e.g. the policy before this
    update, recomputed on the batch) instead:

    .. math::
       w_t = \mathrm{sg}\big(\min(\pi_{prox} / \pi_{behav},\ C)\big), \quad
       r_t = \pi_\theta / \pi_{prox}, \\
       L_t = w_t \cdot \max\big(-A_t r_t,\;
             -A_t\,\mathrm{clip}(r_t, 1-\epsilon_{lo}, 1+\epsilon_{hi})\big) \cdot v_t,

    where the bracket is exactly `policy_loss(logp, prox_logp, ...)` (dual clip and the GSPO
    sequence ratio included, see there) and :math:`v_t` the optional extra `weights`. The
    ratios are :math:`\exp` of log-ratios clamped to [-20, 20]. With
    :math:`\pi_{prox} = \pi_{behav}`, :math:`w_t = 1` and this is `policy_loss` exactly.

    The cap :math:`C` ("is_cap") bounds the variance of :math:`w_t`: `is_cap_mode="truncate"`
    uses :math:`\min(w_t, C)` (truncated IS, as in "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training", Yao et al., 2025); `"mask"` sets :math:`w_t = 0`
    where :math:`w_t > C`, which is what AReaL's code does with `behav_imp_weight_cap`.

    Args:
      logp: float[..., T] log-probs of the taken tokens under the current policy.
      prox_logp: float[..., T] the same under the proximal policy (no gradient needed).
      behav_logp: float[..., T] the same under the policy that sampled each token.
      advantages: float[...] (one per sequence) or float[..., T].
      mask: bool or float[..., T]; positions with mask 0 get loss 0.
      weights: optional float[..., T] extra per-token multipliers :math:`v_t`, e.g.
        `sequence_is_mask`; treated as constants (stop-gradient).
      clip_low, clip_high, dual_clip, ratio: as in `policy_loss`; `ratio="sequence"`
        makes the GSPO ratio :math:`\pi_\theta / \pi_{prox}` per sequence, while
        :math:`w_t` stays per token.
      is_cap: :math:`C > 0`, or None for no cap.
      is_cap_mode: "truncate" or "mask".
      return_aux: also return per-token diagnostics (see Returns).

    Returns:
      float[..., T] per-token loss (0 where masked); reduce it with `aggregate`. With
      `return_aux`, `(loss, aux)`: aux holds `policy_loss`'s float[..., T] arrays (for
      :math:`r_t`) plus "is_weight" (:math:`w_t` after the cap) and "is_truncated" (1
      where the cap was active), all 0 where the mask is 0.
    """
    _check_clip_args(clip_low, clip_high, dual_clip, ratio)
    _check_cap("is_cap", is_cap, is_cap_mode)
    adv = _check_token_args(logp, prox_logp, advantages, mask, "prox_logp")
    _check_log_ratio_args(prox_logp, behav_logp, mask, "prox_logp", "behav_logp")
    if weights is not None:
        check_array("weights", weights, shape=logp.shape, kind="float", layout="[..., T]")
    valid = mask > 0
    surrogate, aux = _clipped_surrogate(
        logp, prox_logp, adv, valid, clip_low, clip_high, dual_clip, ratio
    )
    w, capped = _behaviour_weights(prox_logp, behav_logp, valid, is_cap, is_cap_mode)
    loss = surrogate * w.astype(surrogate.dtype)
    if weights is not None:
        loss = loss * jax.lax.stop_gradient(weights).astype(loss.dtype)
    loss = jnp.where(valid, loss, 0.0)
    aux["is_weight"] = w
    aux["is_truncated"] = capped.astype(w.dtype)
    return (loss, aux) if return_aux else loss


#: `decoupled_policy_loss` with `return_aux=True`: returns `(loss, aux)`.
decoupled_policy_loss_with_aux = functools.partial(decoupled_policy_loss, return_aux=True)


def truncated_is_weights(
    logp_target, logp_behav, mask, *, cap: float | None = 2.0, mode: str = "truncate"
):
    r"""Token-level truncated (TIS) or masked importance weights, stop-gradient.

    TIS, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (Yao et
    al., 2025): with :math:`\rho_t = \exp(\mathrm{clip}(\log\pi_{target} -
    \log\pi_{behav}, -20, 20))`,

    - `mode="truncate"`: :math:`w_t = \min(\rho_t, C)`;
    - `mode="mask"` (token-level masked IS): :math:`w_t = \rho_t [\rho_t \le C]`.

    The target is typically the trainer's recomputed old/proximal log-probs and the
    behaviour the inference engine's (or a stale policy's) log-probs. Multiply the
    per-token loss by `w` before `aggregate` (`aggregate(policy_loss(...) * w, mask, mode)`)
    so the denominator still counts every token; `decoupled_policy_loss` computes the same
    weights itself from `is_cap`/`is_cap_mode`.

    Args:
      logp_target: float[..., T].
      logp_behav: float[..., T].
      mask: bool or float[..., T].
      cap: :math:`C > 0`, or None (plain importance weights).
      mode: "truncate" or "mask".

    Returns:
      (w, truncated): float[..., T] weights and float[..., T] 0/1 where the cap was
      active (:math:`\rho_t > C`); both 0 where the mask is 0.
    """
    _check_cap("cap", cap, mode)
    _check_log_ratio_args(logp_target, logp_behav, mask, "logp_target", "logp_behav")
    w, capped = _behaviour_weights(logp_target, logp_behav, mask > 0, cap, mode)
    return w, capped.astype(w.dtype)


def sequence_is_mask(logp_target, logp_behav, mask, *, threshold: float = 2.0):
    r"""Sequence-level masked importance sampling: 0/1 weights that drop whole sequences.

    Geometric-mean rejection ("Geo-RS"/sequence MIS) from "When Speed Kills Stability:
    Demystifying RL Collapse from the Training-Inference Mismatch" (Liu et al., 2025),
    which extends the TIS/MIS of "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training" (Yao et al., 2025) to sequences. The sequence ratio is the
    geometric mean of the token ratios, which does not grow with the length:

    .. math::
       \bar\rho_i = \exp\Big(\frac{1}{\sum_t m_{it}} \sum_t m_{it}
                    (\log\pi_{target} - \log\pi_{behav})\Big), \quad
       k_{it} = m_{it}\,[1/C \le \bar\rho_i \le C].

    Use `k` as (part of) the aggregation mask (`aggregate(loss, mask * k, mode)`) so the
    dropped sequences also leave the denominator, or pass it as `weights` to
    `decoupled_policy_loss` to zero their loss only.

    Args:
      logp_target: float[..., T].
      logp_behav: float[..., T].
      mask: bool or float[..., T]; sequences with no valid token get 0.
      threshold: :math:`C > 1`.

    Returns:
      float32[..., T]: 1 on the valid tokens of kept sequences, 0 elsewhere.
    """
    if not threshold > 1:
        raise ValueError(f"threshold: expected a value > 1, got {threshold!r}")
    _check_log_ratio_args(logp_target, logp_behav, mask, "logp_target", "logp_behav")
    valid = mask > 0
    log_rho = jnp.where(valid, logp_target - logp_behav, 0.0).astype(jnp.float32)
    count = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1)
    mean_log = jnp.sum(log_rho, axis=-1, keepdims=True) / count  # [..., 1]
    # compare in log space: no overflow for long, very off-policy sequences
    bound = jnp.log(jnp.float32(threshold))
    keep = (mean_log >= -bound) & (mean_log <= bound)
    return jax.lax.stop_gradient((valid & keep).astype(jnp.float32))


def staleness(versions, current_version, mask, *, is_truncated=None):
    r"""Off-policyness diagnostics: policy-version lag of the trained tokens.

    With :math:`\ell_t = v_{cur} - v_t` the number of updates since token :math:`t` was
    sampled (partial rollouts mix versions within a sequence), over the valid tokens:
    "mean" :math:`= \sum_t m_t \ell_t / \sum_t m_t`, "max" :math:`= \max_{m_t > 0} \ell_t`
    (both 0 when no token is valid) and, when `is_truncated` is given (e.g. the aux of
    `decoupled_policy_loss` or `truncated_is_weights`), "truncated_frac" :math:`= \sum_t
    m_t c_t / \sum_t m_t`, the fraction of tokens whose importance weight hit the cap.

    Args:
      versions: int[..., T] policy version that sampled each token.
      current_version: int scalar (Python or array) version of the policy being trained.
      mask: bool or float[..., T].
      is_truncated: optional bool or float[..., T] 0/1 cap indicators.

    Returns:
      dict of float32 scalars "mean", "max" and, with `is_truncated`, "truncated_frac".
    """
    check_array("versions", versions, kind="int", layout="[..., T]")
    check_array("mask", mask, shape=versions.shape, kind="bool_or_float", layout="[..., T]")
    current = jnp.asarray(current_version)
    if current.ndim != 0 or not jnp.issubdtype(current.dtype, jnp.integer):
        raise TypeError(
            f"current_version: expected an int scalar, got {current.dtype} {current.shape}"
        )
    valid = mask > 0
    lag = (current - versions).astype(jnp.float32)
    tokens = jnp.sum(valid).astype(jnp.float32)
    denom = jnp.maximum(tokens, 1.0)
    out = {
        "mean": jnp.sum(jnp.where(valid, lag, 0.0)) / denom,
        "max": jnp.where(tokens > 0, jnp.max(jnp.where(valid, lag, -jnp.inf)), 0.0),
    }
    if is_truncated is not None:
        check_array(
            "is_truncated",
            is_truncated,
            shape=versions.shape,
            kind="bool_or_float",
            layout="[..., T]",
        )
        out["truncated_frac"] = jnp.sum(valid & (is_truncated > 0)).astype(jnp.float32) / denom
    return out


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
