"""The jitted policy update: log-probs, clipped loss, KL and entropy terms, accumulation.

`make_train_step(...)` returns a pure `(state, batch) -> (state, metrics)`
that the trainer wraps in `jax.jit` (with shardings and donation). One call runs
`num_iterations` PPO epochs; each epoch shuffles the rollouts and takes one optimizer
step per mini-batch, accumulating gradients over micro-batches with `lax.scan`. The loss
of a mini-batch is sum(totals) / sum(denominators) over its micro-batches (see
`losses.aggregate`), so the gradient does not depend on the micro-batch size.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxrl_llm import losses
from jaxrl_llm._checks import check_choice
from jaxrl_llm.models import ModelConfig, lora, positions_from_mask, token_logps_and_entropy


@struct.dataclass
class TrainState:
    """Everything the update changes; checkpointing it (with the data state) resumes a run."""

    step: jnp.ndarray  # int32[] optimizer steps taken so far (one per mini-batch)
    params: dict  # policy parameters
    opt_state: optax.OptState
    rng: jnp.ndarray  # uint32[2] raw PRNG key data, consumed by the trainer and the step
    transform_state: tuple = ()  # state of the advantage transform chain


@struct.dataclass
class TrainBatch:
    """N = P * G rollouts, each a left-padded prompt followed by its completion."""

    tokens: jnp.ndarray  # int32[N, Lp + T] prompt (left-padded) then completion
    attention_mask: jnp.ndarray  # bool[N, Lp + T] real tokens (prompt and completion)
    loss_weights: jnp.ndarray  # float32[N, T] per completion token (sample x token weight)
    advantages: jnp.ndarray  # float32[N]
    old_logps: jnp.ndarray  # float32[N, T] log-probs under the sampling policy
    ref_logps: jnp.ndarray  # float32[N, T] under the reference policy (zeros if beta = 0)
    # float32[N, T] log-probs of the policies that sampled each token, when they differ from
    # `old_logps` (partial or asynchronous rollouts): the loss is then the decoupled PPO
    # objective with `old_logps` as the proximal policy. None = on-policy PPO.
    behav_logps: jnp.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Static hyperparameters of the policy loss (hashable, so jit can close over it)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    ratio: str = "token"  # "token" (PPO/GRPO) or "sequence" (GSPO)
    aggregation: str = "seq-mean-token-mean"
    max_len: int | None = None  # for "seq-mean-token-sum-norm"; default T
    beta: float = 0.0  # KL(pi || pi_ref) coefficient; 0 skips the reference model
    kl_kind: str = "k3"
    entropy_coef: float = 0.0  # entropy bonus: loss -= coef * H
    temperature: float = 1.0  # the sampler's; logits are divided by it for logp and H
    num_iterations: int = 1  # PPO epochs over one batch of rollouts
    num_minibatches: int = 1  # optimizer steps per epoch
    micro_batch_size: int = 0  # rows per gradient-accumulation step; 0 = whole mini-batch
    # Decoupled PPO (batches with behav_logps): cap C of the behaviour importance weight
    # pi_prox / pi_behav (None = uncapped), "truncate" (min(w, C)) or "mask" (w > C -> 0).
    is_cap: float | None = 2.0
    is_cap_mode: str = "truncate"
    # Decoupled PPO with one optimizer step per batch (num_iterations = num_minibatches =
    # 1): the proximal policy is the parameters being differentiated, so the loss takes
    # pi_prox = stop_gradient(pi_theta) from its own forward pass and ignores old_logps;
    # the trainer then skips the separate proximal pass (one forward per step fewer).
    current_proximal: bool = False

    def __post_init__(self):
        check_choice("loss.ratio", self.ratio, losses.RATIO_LEVELS)
        check_choice("loss.aggregation", self.aggregation, losses.AGGREGATION_MODES)
        check_choice("loss.kl_kind", self.kl_kind, losses.KL_KINDS)
        for name in ("num_iterations", "num_minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"loss.{name}: expected >= 1, got {getattr(self, name)}")
        if self.micro_batch_size < 0:
            raise ValueError(f"loss.micro_batch_size: expected >= 0, got {self.micro_batch_size}")
        if not self.temperature > 0:
            raise ValueError(f"loss.temperature: expected > 0, got {self.temperature}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"loss.dual_clip: expected > 1 or None, got {self.dual_clip}")
        check_choice("loss.is_cap_mode", self.is_cap_mode, losses.IS_CAP_MODES)
        if self.is_cap is not None and not self.is_cap > 0:
            raise ValueError(f"loss.is_cap: expected > 0 or None, got {self.is_cap}")

    def micro_batches(self, rows: int) -> tuple[int, int]:
        """(mini-batch rows, micro-batches per mini-batch) for a batch of `rows`."""
        if rows % self.num_minibatches:
            raise ValueError(
                f"loss.num_minibatches: {self.num_minibatches} does not divide the batch "
                f"of {rows} rollouts"
            )
        mini = rows // self.num_minibatches
        micro = self.micro_batch_size or mini
        if mini % micro:
            raise ValueError(
                f"loss.micro_batch_size: {micro} does not divide the mini-batch of {mini} rollouts"
            )
        return mini, mini // micro


SUM_KEYS = (
    "tokens",
    "policy_loss",
    "kl",
    "entropy",
    "ratio",
    "clip_frac_high",
    "clip_frac_low",
    "dual_clip_frac",
    "approx_kl_old",
)
# Also summed for decoupled (off-policy) batches: the mean behaviour weight after the cap
# and the fraction of tokens whose weight the cap changed.
OFF_POLICY_KEYS = ("is_weight", "is_truncated_frac")


def completion_logps(params, model: ModelConfig, batch: TrainBatch, temperature: float):
    """Per completion token log-prob and entropy under softmax(logits / temperature).

    Returns (logps float32[N, T], entropy float32[N, T]); column t scores the t-th
    completion token, predicted from position Lp + t - 1.
    """
    t = batch.loss_weights.shape[-1]
    prompt_len = batch.tokens.shape[-1] - t
    positions = positions_from_mask(batch.attention_mask)
    # Only the completion's positions are unembedded (no logits for the prompt).
    return token_logps_and_entropy(
        params,
        model,
        batch.tokens,
        positions,
        batch.attention_mask,
        temperature,
        start=prompt_len - 1,
    )  # [N, T] each


def loss_terms(params, model: ModelConfig, cfg: LossConfig, batch: TrainBatch):
    """(total, aux): the aggregated loss numerator of one micro-batch and its statistics.

    Per token: :math:`\\ell_t = L^{clip}_t + \\beta\\,\\mathrm{KL}_t - c_H H_t`, aggregated
    with `cfg.aggregation`; aux holds the numerators of the diagnostics (token sums).
    With `batch.behav_logps`, :math:`L^{clip}_t` is `losses.decoupled_policy_loss` (AReaL's
    decoupled PPO: clipped against `old_logps` as the proximal policy, weighted by the
    capped pi_prox / pi_behav).
    """
    logps, ent = completion_logps(params, model, batch, cfg.temperature)
    w = batch.loss_weights
    clip = dict(
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, ratio=cfg.ratio
    )
    decoupled = batch.behav_logps is not None
    # The reference of the clipped ratio: the batch's old (proximal) log-probs, or with
    # `current_proximal` the current policy's own, without gradient.
    old = jax.lax.stop_gradient(logps) if decoupled and cfg.current_proximal else batch.old_logps
    if decoupled:
        pg, aux = losses.decoupled_policy_loss_with_aux(
            logps,
            old,
            batch.behav_logps,
            batch.advantages,
            w,
            is_cap=cfg.is_cap,
            is_cap_mode=cfg.is_cap_mode,
            **clip,
        )
    else:
        pg, aux = losses.policy_loss_with_aux(logps, batch.old_logps, batch.advantages, w, **clip)
    per_token = pg
    kl = jnp.zeros_like(pg)
    if cfg.beta:
        kl = losses.kl_penalty(logps, batch.ref_logps, cfg.kl_kind)
        per_token = per_token + cfg.beta * kl
    if cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * ent
    total, _ = losses.aggregate(per_token, w, cfg.aggregation, max_len=cfg.max_len)
    on = (w > 0).astype(jnp.float32)
    sums = {
        "tokens": jnp.sum(on),
        "policy_loss": jnp.sum(pg * on),
        "kl": jnp.sum(kl * on),
        "entropy": jnp.sum(jax.lax.stop_gradient(ent) * on),
        "ratio": jnp.sum(aux["ratio"] * on),
        "clip_frac_high": jnp.sum(aux["clipped_high"] * on),
        "clip_frac_low": jnp.sum(aux["clipped_low"] * on),
        "dual_clip_frac": jnp.sum(aux["dual_clipped"] * on),
        "approx_kl_old": jnp.sum(0.5 * jnp.square(logps - old) * on),
    }
    if decoupled:
        sums["is_weight"] = jnp.sum(aux["is_weight"] * on)
        sums["is_truncated_frac"] = jnp.sum(aux["is_truncated"] * on)
    return total, sums


def _strided_split(x: jax.Array, n: int) -> jax.Array:
    """[R, ...] -> [n, R / n, ...], part j = rows j, j + n, j + 2n, ...

    Strided, not contiguous: on a mesh that splits rows into contiguous blocks, every
    part then has the same number of rows on every device, so a scan over the parts
    keeps all devices busy and moves no rows. The loss does not depend on the partition
    (sums of (total, denominator) pairs, see `losses.aggregate`).
    """
    return x.reshape(-1, n, *x.shape[1:]).swapaxes(0, 1)


def make_train_step(model: ModelConfig, cfg: LossConfig, optimizer: optax.GradientTransformation):
    """Builds `step(state, batch) -> (state, metrics)` (pure; jit it).

    Reference log-probs arrive precomputed in the batch (`TrainBatch.ref_logps`), so
    the step never holds a second copy of the parameters.

    `state.params` are the trained parameters. With LoRA they are the adapters only and
    `frozen` (the third argument of `step`) is the base they adapt: the policy is
    `lora.combine(state.params, frozen)`, and gradients, optimizer state and updates
    exist for the adapters alone. Without LoRA `frozen` is None (or {}).

    Metrics are means over the mini-batch updates of the call: "loss", "grad_norm"
    (before clipping), and token means of "policy_loss", "kl", "entropy", "ratio",
    "clip_frac_high", "clip_frac_low", "dual_clip_frac", "approx_kl_old"; with
    `batch.behav_logps` also "is_weight" and "is_truncated_frac".
    """

    def minibatch_update(carry, mb: TrainBatch, frozen):
        params, opt_state = carry
        _, n_micro = cfg.micro_batches(cfg.num_minibatches * mb.tokens.shape[0])
        _, denom = losses.aggregate(
            jnp.zeros_like(mb.loss_weights), mb.loss_weights, cfg.aggregation, max_len=cfg.max_len
        )
        denom = jnp.maximum(denom, 1e-8)  # an all-masked mini-batch gives a zero update
        micro = jax.tree.map(functools.partial(_strided_split, n=n_micro), mb)

        def objective(trainable, mic):
            return loss_terms(lora.combine(trainable, frozen), model, cfg, mic)

        def accumulate(acc, mic):
            grads, sums = acc
            (total, s), g = jax.value_and_grad(objective, has_aux=True)(params, mic)
            s = {**s, "loss_total": total}
            return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, sums, s)), None

        keys = (*SUM_KEYS, *(OFF_POLICY_KEYS if mb.behav_logps is not None else ()))
        zero_sums = {k: jnp.zeros((), jnp.float32) for k in (*keys, "loss_total")}
        grads0 = jax.tree.map(jnp.zeros_like, params)
        (grads, sums), _ = jax.lax.scan(accumulate, (grads0, zero_sums), micro)
        grads = jax.tree.map(lambda g: g / denom, grads)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        # Optimizer state keeps the dtypes it was created with: with bfloat16 params the
        # AdamW moments are bfloat16 too (float32 master weights: model.param_dtype).
        opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_opt_state, opt_state)
        params = optax.apply_updates(params, updates)
        tokens = jnp.maximum(sums.pop("tokens"), 1.0)
        metrics = {k: v / tokens for k, v in sums.items() if k != "loss_total"}
        metrics["loss"] = sums["loss_total"] / denom
        metrics["grad_norm"] = grad_norm
        return (params, opt_state), metrics

    def step(state: TrainState, batch: TrainBatch, frozen=None):
        frozen = {} if frozen is None else frozen
        update = functools.partial(minibatch_update, frozen=frozen)
        rows = batch.tokens.shape[0]
        cfg.micro_batches(rows)  # validates the divisibility at trace time
        rng, perm_key = jax.random.split(jax.random.wrap_key_data(state.rng))
        keys = jax.random.split(perm_key, cfg.num_iterations)

        def epoch(carry, key):
            shuffled = batch
            if cfg.num_minibatches > 1:  # one mini-batch: the order of rows cannot matter,
                # and a gather across a batch-sharded mesh would move every row.
                perm = jax.random.permutation(key, rows)
                shuffled = jax.tree.map(lambda x: x[perm], batch)
            mbs = jax.tree.map(functools.partial(_strided_split, n=cfg.num_minibatches), shuffled)
            return jax.lax.scan(update, carry, mbs)

        (params, opt_state), metrics = jax.lax.scan(epoch, (state.params, state.opt_state), keys)
        metrics = jax.tree.map(jnp.mean, metrics)
        new_state = state.replace(
            step=state.step + cfg.num_iterations * cfg.num_minibatches,
            params=params,
            opt_state=opt_state,
            rng=jax.random.key_data(rng),
        )
        return new_state, metrics

    return step


def make_optimizer(
    *,
    learning_rate: float,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: str = "cosine",
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    max_grad_norm: float = 1.0,
) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine decay (or constant), after global-norm clipping."""
    check_choice("optim.schedule", schedule, ("cosine", "constant"))
    if schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(
            0.0,
            learning_rate,
            max(warmup_steps, 1),
            max(total_steps, warmup_steps + 1),
            0.1 * learning_rate,
        )
    else:
        lr = optax.join_schedules(
            [
                optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1)),
                optax.constant_schedule(learning_rate),
            ],
            [max(warmup_steps, 1)],
        )
    parts = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
    parts.append(optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay))
    return optax.chain(*parts)
