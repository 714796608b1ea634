r"""VADE: online per-prompt difficulty estimates and variance-aware prompt selection.

"VADE: Variance-Aware Dynamic Sampling via Online Sample-Level Difficulty Estimation for
Multimodal RL" (Hu et al., 2025, arXiv:2511.18902). Group-based policy optimization (GRPO,
GSPO) learns nothing from a group whose G rollouts all get the same reward. VADE picks, before
rollout, the prompts whose groups are likely to be mixed, from three parts:

1. an online Beta posterior of each prompt's success probability :math:`p_i`;
2. a Thompson sampler: draw :math:`\tilde p_i \sim \mathrm{Beta}(\alpha_i, \beta_i)` for every
   candidate and keep the candidates whose draw carries the most information;
3. a two-scale prior decay that lets old evidence fade, so the estimate follows the policy.

What we had of the paper is its abstract (the three parts above); the exact equations and
hyperparameters below are ours, chosen to fit those parts, and each function says what it
computes. Where we may differ from the paper:

* the two decay scales are (a) a per-training-step decay :math:`\gamma` of every prompt's
  evidence and (b) a per-visit decay :math:`\lambda` of a prompt's old evidence when a new
  group of it is scored (see `decay` and `update`);
* the information of a draw is the chance that a group of G rollouts is *not* all-equal,
  :math:`1 - p^G - (1-p)^G` (`information_score`). Its ranking of candidates is the same as
  that of the Bernoulli reward variance :math:`p(1-p)`: both are symmetric about 1/2 and
  fall as :math:`|p - 1/2|` grows, so which of the two the paper uses does not change which
  prompts are selected;
* graded rewards count as a success when they are above ``success_threshold``.

Two layers, as elsewhere in the package: pure functions over arrays (`decay`, `update`,
`information_score`, `select`; jax.numpy, also accepting numpy, explicit PRNG keys), and the
host-side `VadeSampler` that holds the per-prompt arrays, indexed by a stable prompt id (the
index of the record in the data source), and checkpoints them as plain arrays.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm._checks import check_array

# Salt folded into the sampler's key so its stream is independent of the trainer's own
# fold_in(key(seed), step) streams.
_KEY_SALT = 0x5ADE


@dataclasses.dataclass(frozen=True)
class VadeConfig:
    r"""Hyperparameters of the VADE prompt sampler (values are ours, not the paper's).

    Attributes:
      alpha0: prior pseudo-successes, > 0. Beta(1, 1) is uniform on p.
      beta0: prior pseudo-failures, > 0.
      step_decay: :math:`\gamma \in (0, 1]`, the factor every prompt's evidence (its
        pseudo-counts above the prior) is multiplied by per training step; 1 keeps it forever.
      visit_decay: :math:`\lambda \in [0, 1]`, the extra factor a prompt's old evidence is
        multiplied by when a new group of it is scored; 0 keeps only the newest group.
      success_threshold: a reward above this counts as a success (graded rewards).
      candidate_factor: candidates drawn per prompt to select (>= 1): the integration draws
        ``candidate_factor * P`` candidate prompts and `VadeSampler.select` keeps P.
    """

    alpha0: float = 1.0
    beta0: float = 1.0
    step_decay: float = 0.99
    visit_decay: float = 0.5
    success_threshold: float = 0.5
    candidate_factor: int = 4

    def __post_init__(self):
        for name in ("alpha0", "beta0"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and np.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
        if not (isinstance(self.step_decay, int | float) and 0 < self.step_decay <= 1):
            raise ValueError(f"step_decay: expected a number in (0, 1], got {self.step_decay!r}")
        if not (isinstance(self.visit_decay, int | float) and 0 <= self.visit_decay <= 1):
            raise ValueError(f"visit_decay: expected a number in [0, 1], got {self.visit_decay!r}")
        threshold = self.success_threshold
        if not (isinstance(threshold, int | float) and np.isfinite(threshold)):
            raise ValueError(f"success_threshold: expected a finite number, got {threshold!r}")
        factor = self.candidate_factor
        if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
            raise ValueError(f"candidate_factor: expected an integer >= 1, got {factor!r}")

    def num_candidates(self, num: int) -> int:
        """How many candidates to draw to select ``num`` prompts: ``candidate_factor * num``."""
        return self.candidate_factor * num


# --------------------------------------------------------------------------------------------
# pure functions
# --------------------------------------------------------------------------------------------


def decay(alpha, beta, last_seen, step, cfg: VadeConfig):
    r"""The Beta parameters at ``step``, evidence decayed toward the prior since ``last_seen``.

    VADE's prior decay (the step scale; "VADE: Variance-Aware Dynamic Sampling via Online
    Sample-Level Difficulty Estimation", Hu et al., 2025): every training step multiplies
    each prompt's evidence, its pseudo-counts above the prior, by :math:`\gamma`
    (``cfg.step_decay``). Applied lazily, for the :math:`\Delta_i = \max(t - s_i, 0)` steps
    since prompt i's arrays were last brought up to date at step :math:`s_i`:

    .. math::
        w_i = \gamma^{\Delta_i},\quad
        \alpha_i' = \alpha_0 + w_i(\alpha_i - \alpha_0),\quad
        \beta_i' = \beta_0 + w_i(\beta_i - \beta_0).

    The posterior mean moves toward the prior mean and the posterior widens, so a prompt
    not seen for long is re-explored. A never-seen prompt sits at the prior and stays there.

    Args:
      alpha: float[N], the Beta parameters as of ``last_seen``.
      beta: float[N].
      last_seen: int[N], the step each prompt's parameters are as of.
      step: int scalar, the current training step.
      cfg: `VadeConfig` (``alpha0``, ``beta0``, ``step_decay``).

    Returns:
      (alpha', beta'), float[N] each.
    """
    alpha, beta = jnp.asarray(alpha, jnp.float32), jnp.asarray(beta, jnp.float32)
    elapsed = jnp.maximum(jnp.asarray(step) - jnp.asarray(last_seen), 0).astype(jnp.float32)
    w = jnp.float32(cfg.step_decay) ** elapsed
    return cfg.alpha0 + w * (alpha - cfg.alpha0), cfg.beta0 + w * (beta - cfg.beta0)


def successes_from_rewards(rewards, valid=None, *, threshold: float = 0.5):
    r"""Per-group success counts from rewards: :math:`s_p = \sum_g [r_{pg} > \tau]\, v_{pg}`.

    For VADE's Beta update ("VADE: Variance-Aware Dynamic Sampling via Online Sample-Level
    Difficulty Estimation", Hu et al., 2025), with graded rewards thresholded at :math:`\tau`
    (``VadeConfig.success_threshold``).

    Args:
      rewards: float[P, G].
      valid: bool[P, G] or None (all valid); invalid rollouts count as neither.
      threshold: :math:`\tau`.

    Returns:
      (successes, trials): float[P] each, trials :math:`n_p = \sum_g v_{pg}`.
    """
    check_array("rewards", rewards, rank=2, layout="[P, G]")
    rewards = jnp.asarray(rewards, jnp.float32)
    if valid is None:
        valid = jnp.ones(rewards.shape, bool)
    check_array("valid", valid, shape=rewards.shape, kind="bool", layout="[P, G]")
    hits = jnp.logical_and(rewards > threshold, valid)
    return hits.sum(-1).astype(jnp.float32), jnp.asarray(valid).sum(-1).astype(jnp.float32)


def update(alpha, beta, last_seen, ids, successes, trials, step, cfg: VadeConfig):
    r"""The Beta posteriors after scoring one group of each prompt in ``ids`` at ``step``.

    VADE's online difficulty estimate with its two-scale decay ("VADE: Variance-Aware Dynamic
    Sampling via Online Sample-Level Difficulty Estimation", Hu et al., 2025). For each
    updated prompt i with :math:`s_i` successes out of :math:`n_i` rollouts, the old evidence
    is first decayed per step (`decay`, factor :math:`\gamma^{\Delta_i}`) and then per visit
    (factor :math:`\lambda` = ``cfg.visit_decay``: the newest group describes the current
    policy better than older ones), then the group is added (Beta-Binomial conjugacy):

    .. math::
        \alpha_i' = \alpha_0 + \lambda\gamma^{\Delta_i}(\alpha_i - \alpha_0) + s_i,\quad
        \beta_i' = \beta_0 + \lambda\gamma^{\Delta_i}(\beta_i - \beta_0) + n_i - s_i,\quad
        \text{last\_seen}_i' = t.

    Other prompts are unchanged (their decay stays lazy). A prompt listed twice gets both
    groups added after a single decay.

    Args:
      alpha: float[N].
      beta: float[N].
      last_seen: int[N].
      ids: int[P], prompt ids in ``[0, N)``.
      successes: float or int[P], successes per group (see `successes_from_rewards`).
      trials: float or int[P] (or a scalar, e.g. the group size G), rollouts per group.
      step: int scalar, the current training step.
      cfg: `VadeConfig`.

    Returns:
      (alpha', beta', last_seen'): float[N], float[N], int[N].
    """
    check_array("ids", ids, rank=1, kind="int", layout="[P]")
    ids = jnp.asarray(ids)
    successes = jnp.broadcast_to(jnp.asarray(successes, jnp.float32), ids.shape)
    trials = jnp.broadcast_to(jnp.asarray(trials, jnp.float32), ids.shape)
    alpha, beta = jnp.asarray(alpha, jnp.float32), jnp.asarray(beta, jnp.float32)
    last_seen = jnp.asarray(last_seen)
    a, b = decay(alpha[ids], beta[ids], last_seen[ids], step, cfg)
    a = cfg.alpha0 + cfg.visit_decay * (a - cfg.alpha0)
    b = cfg.beta0 + cfg.visit_decay * (b - cfg.beta0)
    # Duplicate ids set the same decayed value, then each adds its own group.
    alpha = alpha.at[ids].set(a).at[ids].add(successes)
    beta = beta.at[ids].set(b).at[ids].add(trials - successes)
    last_seen = last_seen.at[ids].set(jnp.asarray(step, last_seen.dtype))
    return alpha, beta, last_seen


def information_score(p, group_size: int):
    r"""The information a group of G rollouts carries at success probability p.

    VADE's selection objective ("VADE: Variance-Aware Dynamic Sampling via Online
    Sample-Level Difficulty Estimation", Hu et al., 2025): a group's advantages vanish when
    its G Bernoulli(p) rewards are all equal, so a prompt's value is the chance that they are
    not,

    .. math:: I(p) = 1 - p^G - (1-p)^G,

    0 at p = 0 or 1, maximal at p = 1/2. It orders any set of p exactly as the reward
    variance :math:`p(1-p)` does (both are symmetric about 1/2 and fall with
    :math:`|p - 1/2|`). Computed from :math:`q = \min(p, 1-p)` as
    :math:`-\mathrm{expm1}(G \log(1-q)) - q^G`, which keeps small values accurate.

    Args:
      p: float[...] in [0, 1].
      group_size: G >= 1.

    Returns:
      float[...] in [0, 1).
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int | np.integer):
        raise TypeError(f"group_size: expected an int, got {type(group_size).__name__}")
    if group_size < 1:
        raise ValueError(f"group_size: expected >= 1, got {group_size}")
    p = jnp.clip(jnp.asarray(p, jnp.float32), 0.0, 1.0)
    q = jnp.minimum(p, 1.0 - p)
    return -jnp.expm1(group_size * jnp.log1p(-q)) - q**group_size


def select(key, alpha, beta, candidate_ids, num: int, group_size: int):
    r"""Thompson selection of the ``num`` most informative candidates.

    VADE's Thompson sampler ("VADE: Variance-Aware Dynamic Sampling via Online Sample-Level
    Difficulty Estimation", Hu et al., 2025): for each candidate c draw
    :math:`\tilde p_c \sim \mathrm{Beta}(\alpha_{id_c}, \beta_{id_c})`, score it
    :math:`I(\tilde p_c)` (`information_score`) and keep the ``num`` highest scores. The
    draw, not the posterior mean, is scored, so uncertain prompts get their turn.

    Deterministic given ``key``; ties go to the earlier position.

    Args:
      key: a JAX PRNG key.
      alpha: float[N], Beta parameters by prompt id, already decayed to the current step
        (`decay`).
      beta: float[N].
      candidate_ids: int[C], prompt ids; C >= num.
      num: how many to keep.
      group_size: G, rollouts per prompt.

    Returns:
      (positions, scores): int32[num] positions into ``candidate_ids`` in descending score,
      and their float32[num] scores.
    """
    check_array("candidate_ids", candidate_ids, rank=1, kind="int", layout="[C]")
    if not 0 < num <= candidate_ids.shape[0]:
        raise ValueError(f"num: expected 1..{candidate_ids.shape[0]} (the candidates), got {num}")
    ids = jnp.asarray(candidate_ids)
    a = jnp.asarray(alpha, jnp.float32)[ids]
    b = jnp.asarray(beta, jnp.float32)[ids]
    p = jax.random.beta(key, a, b)
    scores, positions = jax.lax.top_k(information_score(p, group_size), num)
    return positions.astype(jnp.int32), scores


# --------------------------------------------------------------------------------------------
# host-side sampler
# --------------------------------------------------------------------------------------------


class VadeSampler:
    """The VADE state of a data source's prompts, on the host, with selection and updates.

    Holds per prompt id (``0..num_prompts-1``, the index of the record in the data source):
    ``alpha``/``beta`` (float32, the Beta parameters as of ``last_seen``), ``last_seen``
    (int32, the step they are as of) and ``visits`` (int32, groups scored). Selection at a
    step uses a key derived from (seed, step) alone, so a run resumed from `state_dict`
    selects what the uninterrupted run would have.
    """

    _ARRAYS = (
        ("alpha", np.float32),
        ("beta", np.float32),
        ("last_seen", np.int32),
        ("visits", np.int32),
    )

    def __init__(self, num_prompts: int, cfg: VadeConfig, group_size: int, seed: int = 0):
        if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
            raise ValueError(f"num_prompts: expected an integer >= 1, got {num_prompts!r}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size: expected an integer >= 1, got {group_size!r}")
        self.num_prompts, self.cfg, self.group_size, self.seed = num_prompts, cfg, group_size, seed
        self.alpha = np.full(num_prompts, cfg.alpha0, np.float32)
        self.beta = np.full(num_prompts, cfg.beta0, np.float32)
        self.last_seen = np.zeros(num_prompts, np.int32)
        self.visits = np.zeros(num_prompts, np.int32)
        self._step = 0  # the latest step seen by select/update, for metrics
        self._last: dict[str, float] = {}

    def key(self, step: int) -> jax.Array:
        """The selection key of ``step``: a pure function of (seed, step)."""
        base = jax.random.fold_in(jax.random.key(self.seed), _KEY_SALT)
        return jax.random.fold_in(base, step)

    def _check_ids(self, name: str, ids) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"{name}: expected int[P], got shape {ids.shape} dtype {ids.dtype.name}"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_prompts):
            raise ValueError(
                f"{name}: ids must be in [0, {self.num_prompts}), got {ids.min()}..{ids.max()}"
            )
        return ids

    def posterior(self, ids=None, step: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(alpha, beta) decayed to ``step`` (default: the latest), for ``ids`` or all."""
        step = self._step if step is None else step
        sl = slice(None) if ids is None else self._check_ids("ids", ids)
        a, b = decay(self.alpha[sl], self.beta[sl], self.last_seen[sl], step, self.cfg)
        return np.asarray(a), np.asarray(b)

    def select(self, candidate_ids, num: int, step: int) -> np.ndarray:
        """Positions (int[num], descending score) into ``candidate_ids`` of the prompts to roll
        out at ``step``; see `select` (the function) for the rule."""
        ids = self._check_ids("candidate_ids", candidate_ids)
        self._step = max(self._step, step)
        a, b = self.posterior(ids, step)
        positions, scores = select(self.key(step), a, b, np.arange(len(ids)), num, self.group_size)
        positions = np.asarray(positions)
        chosen = a[positions] / (a[positions] + b[positions])
        self._last["vade/selected/score"] = float(np.mean(np.asarray(scores)))
        self._last["vade/selected/posterior_mean"] = float(np.mean(chosen))
        self._last["vade/selected/never_seen"] = float(np.mean(self.visits[ids[positions]] == 0))
        return positions

    def update(self, ids, rewards, step: int, *, valid=None) -> None:
        """Adds one scored group per prompt in ``ids`` (int[P]) at ``step``.

        ``rewards`` is float[P, G] (a success is a reward above ``cfg.success_threshold``;
        ``valid`` bool[P, G] drops rollouts that should not count), or int/float[P] success
        counts out of ``group_size`` each.
        """
        ids = self._check_ids("ids", ids)
        rewards = np.asarray(rewards)
        if rewards.ndim == 2:
            if rewards.shape[0] != len(ids):
                raise ValueError(f"rewards: expected [{len(ids)}, G], got {rewards.shape}")
            successes, trials = successes_from_rewards(
                rewards, valid, threshold=self.cfg.success_threshold
            )
        elif rewards.shape == ids.shape:
            if valid is not None:
                raise ValueError("valid: only for rewards [P, G], not success counts [P]")
            if np.any(rewards < 0) or np.any(rewards > self.group_size):
                raise ValueError(f"rewards: success counts must be in [0, {self.group_size}]")
            successes, trials = rewards, self.group_size
        else:
            raise ValueError(
                f"rewards: expected [P, G] rewards or [P] success counts with P={len(ids)}, "
                f"got shape {rewards.shape}"
            )
        self._step = max(self._step, step)
        alpha, beta, last_seen = update(
            self.alpha, self.beta, self.last_seen, ids, successes, trials, step, self.cfg
        )
        self.alpha, self.beta = np.asarray(alpha), np.asarray(beta)
        self.last_seen = np.asarray(last_seen)
        np.add.at(self.visits, ids, 1)
        s, n = np.asarray(successes), np.broadcast_to(np.asarray(trials), ids.shape)
        self._last["vade/update/mixed_groups"] = float(np.mean((s > 0) & (s < n)))

    def metrics(self) -> dict[str, float]:
        """Scalars for logging, as of the latest step seen.

        ``vade/posterior_mean/{mean,p10,p50,p90}`` and ``vade/evidence`` (mean pseudo-counts
        above the prior) over the prompts seen at least once (the prior when none is);
        ``vade/solved`` and ``vade/unsolved``: the fraction of those with a posterior mean
        above 0.9 / below 0.1; ``vade/never_seen``: the fraction of all prompts never scored;
        and, once there was one, the latest selection's and update's ``vade/selected/*`` and
        ``vade/update/mixed_groups`` (the fraction of groups neither all right nor all wrong).
        """
        seen = self.visits > 0
        out = {"vade/never_seen": float(np.mean(~seen))}
        if seen.any():
            # Decayed over all prompts, then masked: one array shape per sampler, so the
            # eager jax ops are not recompiled for every new count of seen prompts.
            a, b = self.posterior()
            a, b = a[seen], b[seen]
            mean = a / (a + b)
            evidence = float(np.mean(a + b - self.cfg.alpha0 - self.cfg.beta0))
        else:
            mean = np.array([self.cfg.alpha0 / (self.cfg.alpha0 + self.cfg.beta0)])
            evidence = 0.0
        p10, p50, p90 = np.percentile(mean, [10, 50, 90])
        out.update(
            {
                "vade/posterior_mean/mean": float(np.mean(mean)),
                "vade/posterior_mean/p10": float(p10),
                "vade/posterior_mean/p50": float(p50),
                "vade/posterior_mean/p90": float(p90),
                "vade/evidence": evidence,
                "vade/solved": float(np.mean(mean > 0.9)) if seen.any() else 0.0,
                "vade/unsolved": float(np.mean(mean < 0.1)) if seen.any() else 0.0,
            }
        )
        out.update(self._last)
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        """The state as plain numpy arrays (for an Orbax checkpoint; no pickled objects)."""
        state = {name: getattr(self, name).copy() for name, _ in self._ARRAYS}
        state["step"] = np.asarray(self._step, np.int64)
        return state

    def load_state_dict(self, state) -> None:
        """Restores `state_dict`'s arrays; a missing key or a shape mismatch raises."""
        missing = [name for name, _ in self._ARRAYS if name not in state]
        if missing:
            raise ValueError(f"VADE state: missing {missing}; expected {self._expected()}")
        for name, dtype in self._ARRAYS:
            value = np.asarray(state[name])
            if value.shape != (self.num_prompts,):
                raise ValueError(
                    f"VADE state: {name!r} has shape {value.shape}, expected "
                    f"({self.num_prompts},): the checkpoint was saved for a data source of "
                    f"{value.shape[0] if value.ndim == 1 else '?'} prompts, this one has "
                    f"{self.num_prompts}"
                )
            setattr(self, name, value.astype(dtype, copy=True))
        self._step = int(np.asarray(state.get("step", 0)))
        self._last = {}

    def _expected(self) -> list[str]:
        return [name for name, _ in self._ARRAYS] + ["step"]
