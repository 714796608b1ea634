"""Composable (init, apply) transforms over `Rollouts`, in the style of optax.

A transform is a pair of pure functions; `chain(...)` composes several into one whose
state is the tuple of their states, so running statistics and schedules ride inside
the `TrainState` and are checkpointed with it::

    estimator = chain(
        combine_rewards(weights=(1.0, 0.5), decoupled=True),  # GDPO
        group_advantages("median", scale="none"),             # MC-GRPO, pivot excluded
        drop_uninformative_groups(),                          # DAPO dynamic sampling
        keep_max_variance_rollouts(k=4),                      # PODS / D3S samples
        keep_top_tokens(fraction=0.5),                        # D3S tokens
    )
    state = estimator.init(rollouts)
    rollouts, state = estimator.apply(rollouts, state)  # jit-able, once per RL step

Every transform reads only the *active* members (valid, sample weight > 0), writes
`scores`, `advantages`, `sample_weight` or `token_weight`, and is also available as
the plain array function it wraps (`advantages.py`, `downsample.py`).

A transform that follows a schedule counts its own applications in its state, as optax's
schedules count updates: the count is RL steps (one `apply` per batch of rollouts), not
optimizer steps, whatever the number of PPO epochs or mini-batches. A transform also
declares the optional `Rollouts` fields it reads (`needs`, e.g. {"entropy"}), so the
trainer computes exactly those and never re-derives the chain's configuration.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp

from jaxrl_llm import advantages as adv_lib
from jaxrl_llm import downsample
from jaxrl_llm._checks import check_choice
from jaxrl_llm.types import Rollouts


class EmptyState(NamedTuple):
    """State of a transform that keeps none."""


class CountState(NamedTuple):
    """State of a scheduled transform: how many times it has been applied."""

    count: Any  # int32[] applications so far (RL steps)


# Optional `Rollouts` fields a transform may declare in `needs`.
NEEDS = ("entropy", "kl")


class RolloutTransform(NamedTuple):
    """`init(rollouts) -> state`; `apply(rollouts, state) -> (rollouts, state)`.

    `needs`: the optional `Rollouts` fields (from `NEEDS`) that `apply` reads, which
    the caller must fill (e.g. "entropy": per-token policy entropy, an extra forward pass;
    "kl": per-token KL of the old policy to the reference, which needs the reference model).
    """

    init: Callable[[Rollouts], Any]
    apply: Callable[[Rollouts, Any], tuple[Rollouts, Any]]
    needs: frozenset = frozenset()


def stateless(fn: Callable[[Rollouts], Rollouts], needs=frozenset()) -> RolloutTransform:
    """Wraps `fn(rollouts) -> rollouts` as a transform with `EmptyState`."""
    return RolloutTransform(
        init=lambda rollouts: EmptyState(),
        apply=lambda rollouts, state: (fn(rollouts), state),
        needs=frozenset(needs),
    )


def chain(*transforms: RolloutTransform) -> RolloutTransform:
    """Applies `transforms` in order; the state is the tuple of their states and the
    needs are the union of theirs."""

    def init(rollouts):
        return tuple(t.init(rollouts) for t in transforms)

    def apply(rollouts, state):
        if len(state) != len(transforms):
            raise ValueError(f"state: expected {len(transforms)} entries, got {len(state)}")
        new_state = []
        for t, s in zip(transforms, state, strict=True):
            rollouts, s = t.apply(rollouts, s)
            new_state.append(s)
        return rollouts, tuple(new_state)

    needs = frozenset().union(*(t.needs for t in transforms))
    return RolloutTransform(init, apply, needs)


def combine_rewards(
    weights: Sequence[float] | None = None, *, decoupled: bool = False, eps: float = 1e-4
) -> RolloutTransform:
    """Sets `scores` from the K reward columns: the weighted sum, or GDPO if `decoupled`.

    `decoupled=True` writes GDPO's batch-normalised advantage-like score
    (`advantages.gdpo`); follow it with a group estimator (e.g. `group_advantages(
    "dr_grpo")`) or `group_advantages("identity")` to use it as the advantage directly.
    """

    def fn(r: Rollouts):
        k = r.rewards.shape[-1]
        w = jnp.ones((k,), jnp.float32) if weights is None else jnp.asarray(weights, jnp.float32)
        if w.shape != (k,):
            raise ValueError(f"weights: expected {k} values (one per reward), got {w.shape[0]}")
        if decoupled:
            scores = adv_lib.gdpo(r.rewards, w, r.active, eps=eps)
        else:
            scores = adv_lib.combine_rewards(r.rewards, w)
        return r.replace(scores=scores)

    return stateless(fn)


def shape_overlong(*, max_len: int, buffer: int, factor: float = 1.0) -> RolloutTransform:
    """Adds DAPO's soft overlong penalty (`advantages.overlong_penalty`) to `scores`."""
    adv_lib.overlong_penalty(0, max_len=max_len, buffer=buffer, factor=factor)  # validates

    def fn(r: Rollouts):
        if r.lengths is None:
            raise ValueError("lengths: shape_overlong needs Rollouts.lengths")
        pen = adv_lib.overlong_penalty(r.lengths, max_len=max_len, buffer=buffer, factor=factor)
        return r.replace(scores=jnp.where(r.valid, r.scores + pen, 0.0))

    return stateless(fn)


class KLRewardState(NamedTuple):
    """State of `kl_in_reward`: the coefficient for the next batch, and metrics."""

    beta: Any  # float32[] the KL coefficient the next `apply` uses
    count: Any  # int32[] applications so far (RL steps)
    kl: Any  # float32[] the batch KL measured by the last apply (`mean_sequence_kl`)


def kl_in_reward(
    beta: float = 0.001, *, target: float | None = None, horizon: float = 10000
) -> RolloutTransform:
    """Lowers `scores` by beta times each sequence's summed KL (verl's `use_kl_in_reward`).

    `scores` of the active members become `s - beta * sum_t m_t kl_t`
    (`advantages.kl_in_reward`), with `Rollouts.kl` the per-token KL estimate of the
    sampling policy to the reference and `m` the token mask. It changes the scores the
    estimator sees, so it must come BEFORE `group_advantages` (and before
    `drop_uninformative_groups`, which then sees the penalised scores: groups of equal
    rewards usually differ by their KL) in a chain. It declares `needs={"kl"}`.

    `target=None` keeps beta fixed. Otherwise beta adapts after every apply with the
    proportional controller of Ziegler et al. (`advantages.adaptive_kl_beta`): with KL the
    batch's mean per-sequence mean KL over the active members (`mean_sequence_kl`) and n
    the number of active members, beta *= 1 + clip(KL / target - 1, +-0.2) * n / horizon.
    As in verl, a batch is penalised with the beta from before its own update.

    The state is `KLRewardState(beta, count, kl)`: `beta` is the coefficient the next
    batch will use, `kl` the last measured batch KL, both scalars for metrics.
    """
    if not beta >= 0:
        raise ValueError(f"beta: expected a non-negative KL coefficient, got {beta!r}")
    if target is not None:
        adv_lib.adaptive_kl_beta(beta, 0.0, target, horizon, 0)  # validates

    def init(rollouts):
        return KLRewardState(
            beta=jnp.asarray(beta, jnp.float32),
            count=jnp.zeros((), jnp.int32),
            kl=jnp.zeros((), jnp.float32),
        )

    def apply(r: Rollouts, state: KLRewardState):
        if r.kl is None:
            raise ValueError(
                "kl: kl_in_reward needs Rollouts.kl (per-token KL of the old policy to the "
                "reference); the caller fills it when 'kl' is in chain.needs"
            )
        mask = jnp.ones_like(r.kl) if r.token_weight is None else r.token_weight
        active = r.active
        scores, _ = adv_lib.kl_in_reward(r.scores, r.kl, mask, state.beta, active)
        current = adv_lib.mean_sequence_kl(r.kl, mask, active)
        new_beta = state.beta
        if target is not None:
            new_beta = adv_lib.adaptive_kl_beta(state.beta, current, target, horizon, active.sum())
        new_state = KLRewardState(beta=new_beta, count=state.count + 1, kl=current)
        return r.replace(scores=scores), new_state

    return RolloutTransform(init, apply, frozenset({"kl"}))


def _identity(rewards, valid=None):
    return jnp.where(valid, rewards, 0.0)


# name -> (array function, fixed keyword arguments). "median" also returns the pivot.
ESTIMATORS: Mapping[str, tuple[Callable, dict]] = {
    "grpo": (adv_lib.grpo, {}),
    "dr_grpo": (adv_lib.grpo, {"scale": "none"}),
    "rloo": (adv_lib.rloo, {}),
    "median": (adv_lib.median_centered, {}),
    "ngrpo": (adv_lib.ngrpo, {}),
    "w_reinforce": (adv_lib.weighted_reinforce, {}),
    "identity": (_identity, {}),
}


def _check_hparams(where: str, fn: Callable, fixed: dict, hparams: dict) -> None:
    params = inspect.signature(fn).parameters
    allowed = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n not in fixed]
    for key in hparams:
        if key not in allowed:
            raise ValueError(
                f"{where}: unknown hyperparameter {key!r}; allowed: {', '.join(allowed) or '-'}"
            )


def group_advantages(kind: str = "grpo", **hparams) -> RolloutTransform:
    """Sets `advantages` from `scores` with the estimator `kind` over the active members.

    Kinds: grpo, dr_grpo, rloo, median (MC-GRPO: also sets the pivot's sample weight to 0,
    so G + 1 sampled rollouts cost G in the update), ngrpo, w_reinforce, identity
    (advantage = score). `hparams` are the estimator's keyword arguments
    (e.g. `scale="batch"`, `eps=...`); unknown ones raise at construction.
    """
    check_choice("kind", kind, ESTIMATORS)
    fn, fixed = ESTIMATORS[kind]
    _check_hparams(f"group_advantages({kind!r})", fn, fixed, hparams)
    kwargs = {**fixed, **hparams}

    def apply(r: Rollouts):
        out = fn(r.scores, r.active, **kwargs)
        if kind == "median":
            out, pivot = out
            return r.replace(advantages=out, sample_weight=jnp.where(pivot, 0.0, r.sample_weight))
        return r.replace(advantages=out)

    return stateless(apply)


def drop_uninformative_groups() -> RolloutTransform:
    """Zeroes the sample weight of groups whose active scores are all equal (DAPO)."""

    def fn(r: Rollouts):
        keep = downsample.informative_groups(r.scores, r.active)
        return r.replace(sample_weight=r.sample_weight * keep[:, None])

    return stateless(fn)


def mask_truncated() -> RolloutTransform:
    """Zeroes the sample weight of truncated rollouts (DAPO's overlong filtering).

    Their rewards still entered the group statistics if this runs after the estimator.
    """

    def fn(r: Rollouts):
        if r.truncated is None:
            raise ValueError("truncated: mask_truncated needs Rollouts.truncated")
        return r.replace(sample_weight=jnp.where(r.truncated, 0.0, r.sample_weight))

    return stateless(fn)


def keep_max_variance_rollouts(k: int, *, score: str = "scores") -> RolloutTransform:
    """Keeps, per group, the k active members of largest `score` variance (PODS / D3S).

    `score` is "scores" (rewards, PODS) or "advantages" (D3S's sample level, after an
    estimator). Place it before `group_advantages` to compute advantages over the kept
    subset only.
    """
    check_choice("score", score, ("scores", "advantages"))
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected a positive int, got {k!r}")

    def fn(r: Rollouts):
        keep = downsample.max_variance_subset(getattr(r, score), k, r.active)
        return r.replace(sample_weight=jnp.where(keep, r.sample_weight, 0.0))

    return stateless(fn)


TOKEN_SCORES = ("adv_x_entropy", "entropy", "abs_adv")


def keep_top_tokens(
    fraction: float | Callable[[Any], Any], *, score: str = "adv_x_entropy"
) -> RolloutTransform:
    """Keeps the top `fraction` of the batch's active tokens by `score` (D3S tokens).

    `fraction` is a float in (0, 1], a schedule `count -> fraction` (e.g.
    `functools.partial(downsample.keep_fraction, start=0.2, end=1.0, steps=100)`), or the
    keyword arguments of `downsample.keep_fraction` as a dict (for configs). A schedule
    is evaluated at the transform's own count of applications (`CountState`), i.e. at
    the RL step, starting from 0.
    Scores: "adv_x_entropy" = |A| * H_t (D3S), "entropy" = H_t (the 80/20 high-entropy
    minority of "Beyond the 80/20 Rule"), "abs_adv" = |A|. The entropy scores declare
    `needs={"entropy"}`.
    """
    check_choice("score", score, TOKEN_SCORES)
    if isinstance(fraction, Mapping):  # a schedule spelled out in a config
        fraction = functools.partial(downsample.keep_fraction, **fraction)
        fraction(0)  # validates the schedule's arguments now
    if not callable(fraction) and not 0 < fraction <= 1:
        raise ValueError(f"fraction: expected a value in (0, 1] or a schedule, got {fraction!r}")
    needs = frozenset() if score == "abs_adv" else frozenset({"entropy"})

    def select(r: Rollouts, f) -> Rollouts:
        weights = r.loss_weights()
        if score != "abs_adv" and r.entropy is None:
            raise ValueError(f"entropy: keep_top_tokens(score={score!r}) needs Rollouts.entropy")
        abs_adv = jnp.broadcast_to(jnp.abs(r.advantages)[..., None], weights.shape)
        if score == "adv_x_entropy":
            s = abs_adv * r.entropy
        elif score == "entropy":
            s = r.entropy
        else:
            s = abs_adv
        keep = downsample.top_token_mask(s, weights > 0, f)
        return r.replace(token_weight=jnp.where(keep, r.token_weight, 0.0))

    if not callable(fraction):
        return stateless(lambda r: select(r, fraction), needs)

    def init(rollouts):
        return CountState(count=jnp.zeros((), jnp.int32))

    def apply(r: Rollouts, state: CountState):
        return select(r, fraction(state.count)), CountState(count=state.count + 1)

    return RolloutTransform(init, apply, needs)


# name -> constructor, for configs: [("group_advantages", {"kind": "grpo"}), ...].
TRANSFORMS: Mapping[str, Callable[..., RolloutTransform]] = {
    "combine_rewards": combine_rewards,
    "shape_overlong": shape_overlong,
    "kl_in_reward": kl_in_reward,
    "group_advantages": group_advantages,
    "drop_uninformative_groups": drop_uninformative_groups,
    "mask_truncated": mask_truncated,
    "keep_max_variance_rollouts": keep_max_variance_rollouts,
    "keep_top_tokens": keep_top_tokens,
}


def from_spec(spec: Sequence[tuple[str, Mapping[str, Any]]]) -> RolloutTransform:
    """Builds `chain(...)` from `[(name, kwargs), ...]`, validating names and arguments."""
    out = []
    for i, item in enumerate(spec):
        if not (isinstance(item, Sequence) and len(item) == 2):
            raise ValueError(f"transforms[{i}]: expected (name, kwargs), got {item!r}")
        name, kwargs = item
        check_choice(f"transforms[{i}]", name, TRANSFORMS)
        try:
            out.append(TRANSFORMS[name](**dict(kwargs)))
        except TypeError as e:  # unknown or missing keyword argument
            raise ValueError(f"transforms[{i}] ({name}): {e}") from None
    return chain(*out)
