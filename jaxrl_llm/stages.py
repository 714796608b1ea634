"""The RL step as a few pure, sharded stages, built once per run and shared by the trainer,
the evaluation and the benchmarks (one code path).

    prompts [N, Lp] --generate--> Rollout --rollouts_to_batch--> TrainBatch
    host: decode + reward functions on each process's own rows -> rewards [N, K]
    policy passes (entropy / recomputed old log-probs / reference log-probs), as needed
    transform chain -> advantages, loss weights --update--> TrainState

`build_stages(...)` jits each stage once with `in_shardings` / `out_shardings` over the
run's mesh (rows over the "batch" rule's axes, parameters by their logical names) and
donation where a buffer is consumed; tracing happens inside `sharding.with_rules`, so the
model's activation annotations and the KV cache follow the same rule table.
Host-side pieces (`local_rows`, `to_global`, `to_host`) move arrays between a process's
own rows and the global, mesh-sharded arrays the compiled stages see; on one process they
are plain transfers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.experimental import multihost_utils

from jaxrl_llm import losses, sharding
from jaxrl_llm import rewards as rewards_lib
from jaxrl_llm.engine import make_continuous_generate_fn, make_partial_generate_fn
from jaxrl_llm.models import ModelConfig, init_params, lora, param_logical_axes
from jaxrl_llm.sampler import Rollout, SamplingConfig, make_generate_fn
from jaxrl_llm.train_step import (
    LossConfig,
    TrainBatch,
    TrainState,
    completion_logps,
    make_train_step,
)
from jaxrl_llm.transforms import RolloutTransform
from jaxrl_llm.types import Rollouts


@struct.dataclass
class Scored:
    """A sampled and scored batch of N = P * G rollouts (group-major), on the mesh."""

    batch: TrainBatch  # advantages 0, loss weights = completion mask
    rewards: jax.Array  # float32[N, K], NaN = the reward function failed
    truncated: jax.Array  # bool[N] no EOS within T tokens


def rollouts_to_batch(prompts: jax.Array, prompt_mask: jax.Array, rollout: Rollout) -> TrainBatch:
    """The train batch of sampled completions, before the transform chain.

    Args:
      prompts: int32[N, Lp] left-padded; prompt_mask: bool[N, Lp].
      rollout: the sampler's output for those prompts ([N, T] fields).
    Returns:
      TrainBatch with tokens [N, Lp + T] = prompt then completion, attention mask likewise,
      loss weights = completion mask (float), old log-probs = the sampler's (0 past EOS),
      advantages and reference log-probs 0 (the chain and the reference pass fill them).
    """
    mask = rollout.completion_mask
    n, t = mask.shape
    return TrainBatch(
        tokens=jnp.concatenate([prompts.astype(jnp.int32), rollout.tokens], axis=1),
        attention_mask=jnp.concatenate([prompt_mask.astype(bool), mask], axis=1),
        loss_weights=mask.astype(jnp.float32),
        advantages=jnp.zeros((n,), jnp.float32),
        old_logps=jnp.where(mask, rollout.logps, 0.0),
        ref_logps=jnp.zeros((n, t), jnp.float32),
    )


def make_rollouts(
    scored: Scored, group_size: int, entropy: jax.Array | None, kl: jax.Array | None = None
) -> Rollouts:
    """`Rollouts` [P, G, ...] of a scored batch, for the transform chain.

    `entropy` and `kl` ([N, T] per-token, or None) fill the optional fields a chain needs.
    """
    b = scored.batch
    n, t = b.loss_weights.shape
    p = n // group_size
    return Rollouts.create(
        scored.rewards.reshape(p, group_size, -1),  # [P, G, K]
        token_mask=b.loss_weights.reshape(p, group_size, t),
        entropy=None if entropy is None else entropy.reshape(p, group_size, t),
        kl=None if kl is None else kl.reshape(p, group_size, t),
        lengths=jnp.sum(b.loss_weights > 0, axis=-1, dtype=jnp.int32).reshape(p, group_size),
        truncated=scored.truncated.reshape(p, group_size),
    )


def apply_chain(
    chain: RolloutTransform,
    group_size: int,
    scored: Scored,
    transform_state: Any,
    entropy: jax.Array | None = None,
    kl: jax.Array | None = None,
) -> tuple[TrainBatch, Rollouts, Any]:
    """Runs the transform chain and writes advantages and loss weights into the batch."""
    ro = make_rollouts(scored, group_size, entropy, kl)
    ro, transform_state = chain.apply(ro, transform_state)
    n, t = scored.batch.loss_weights.shape
    batch = scored.batch.replace(
        advantages=ro.advantages.reshape(n), loss_weights=ro.loss_weights().reshape(n, t)
    )
    return batch, ro, transform_state


def trained_groups(
    chain: RolloutTransform, group_size: int, scored: Scored, transform_state: Any
) -> jax.Array:
    """bool[P]: the groups the chain would train on (some member with a positive sample
    weight and a non-zero advantage) — DAPO's dynamic-sampling criterion, taken from the
    chain itself. The chain's state is not advanced. Token-level selections (which may
    need the policy's entropy) are not part of the criterion: they run once, on the final
    batch."""
    entropy = None
    if "entropy" in chain.needs:
        entropy = jnp.zeros_like(scored.batch.loss_weights)
    # KL in the reward is left out too: the criterion is about the verifier's rewards.
    kl = jnp.zeros_like(scored.batch.loss_weights) if "kl" in chain.needs else None
    _, ro, _ = apply_chain(chain, group_size, scored, transform_state, entropy, kl)
    return jnp.any((ro.sample_weight > 0) & (ro.advantages != 0), axis=-1)


def select_groups(scored: Scored, groups: jax.Array, group_size: int) -> Scored:
    """The rows of `groups` (int32[P'], group indices), in that order."""
    rows = (groups[:, None] * group_size + jnp.arange(group_size)).reshape(-1)
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=0), scored)


def concat(parts: Sequence[Scored]) -> Scored:
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *parts)


# ------------------------------------------------------------------------------ host side


def to_host_tree(tree):
    """`to_host` of every leaf."""
    return jax.tree.map(to_host, tree)


def to_host(x) -> np.ndarray:
    """The whole (global) array on this host; gathers across processes when needed."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a batch-sharded global array, in row order."""
    if x.is_fully_addressable:
        return np.asarray(x)
    shards = {s.index[0].start or 0: s for s in x.addressable_shards}  # replicas collapse
    return np.concatenate([np.asarray(shards[k].data) for k in sorted(shards)], axis=0)


def to_global(local: np.ndarray, sharding_: jax.sharding.NamedSharding) -> jax.Array:
    """A global array from each process's rows (a contiguous block, in process order)."""
    return jax.make_array_from_process_local_data(sharding_, np.asarray(local))


def replicate(tree, rep: jax.sharding.NamedSharding):
    """Every array leaf of `tree` (the same value on every process) as a replicated global
    array; works across processes, where `device_put` onto other hosts' devices cannot."""

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, rep, lambda index: x[index])

    return jax.tree.map(put, tree)


def key_data(key: jax.Array, rep: jax.sharding.NamedSharding) -> jax.Array:
    """A typed PRNG key's raw data, replicated over the mesh (the stages' key argument)."""
    return replicate(jax.random.key_data(key), rep)


def process_rows(n: int) -> slice:
    """The block of `n` global rows this process holds."""
    k, i = jax.process_count(), jax.process_index()
    return slice(i * n // k, (i + 1) * n // k)


def decode_and_score(
    generate: Callable,
    params,
    prompts: jax.Array,
    prompt_mask: jax.Array,
    key: jax.Array,
    *,
    answers: Sequence[str],
    metadata: Sequence[Any],
    reward_fns: rewards_lib.RewardPool | Sequence[Any],
    decode: Callable[[list[int]], str],
    timer: Callable[[str], Any] | None = None,
) -> tuple[Rollout, rewards_lib.ScoreResult]:
    """Samples completions and scores this process's rows where they live.

    Used by training (G samples per prompt) and evaluation (greedy, or n samples).

    Args:
      generate: a compiled sampler `(params, prompts, mask, key_data) -> Rollout`.
      prompts, prompt_mask: global [N, Lp] arrays sharded by rows.
      key: the sampler's key argument (`key_data`).
      answers, metadata: this process's rows' reference answers and task fields.
      reward_fns: a `rewards.RewardPool`, or reward functions or names.
      decode: token ids -> text.
      timer: optional `metrics.StageTimer`; times the "sample" and "score" stages.
    Returns:
      (the global Rollout, the `rewards.ScoreResult` of this process's rows: `.rewards`
      float32[n_local, K], NaN where a reward function failed, and the failure counts).
    """
    stage = timer or (lambda name: contextlib.nullcontext())
    with stage("sample"):
        rollout = jax.block_until_ready(generate(params, prompts, prompt_mask, key))
    with stage("score"):
        tokens, lengths = local_rows(rollout.tokens), local_rows(rollout.lengths)
        if len(answers) != tokens.shape[0]:
            raise ValueError(f"answers: {len(answers)} for {tokens.shape[0]} local rows")
        texts = [decode(tokens[i, : lengths[i]].tolist()) for i in range(tokens.shape[0])]
        result = rewards_lib.score_with_errors(
            reward_fns, texts, lengths, list(answers), list(metadata)
        )
    return rollout, result


# ------------------------------------------------------------------------------ compiled


@dataclasses.dataclass(frozen=True)
class Stages:
    """The compiled stages of one run and the shardings they use."""

    mesh: jax.sharding.Mesh
    rules: tuple
    rows: jax.sharding.NamedSharding  # [N, ...] arrays: rows over the batch axes
    replicated: jax.sharding.NamedSharding
    param_shardings: Any  # of the policy: base + adapters under LoRA
    frozen_shardings: Any  # of the frozen base under LoRA, else {}
    state_shardings: TrainState
    init_params: Callable[[], Any]  # () -> policy params, created sharded
    init_state: Callable[[Any, Any], TrainState]  # (trained params, transform_state) -> state
    generate: Callable  # (params, prompts, mask, key) -> Rollout
    greedy: Callable
    eval_generate: Callable
    to_batch: Callable  # (prompts, mask, rollout) -> TrainBatch
    policy_pass: Callable  # (params, batch) -> (logps, entropy) [N, T]
    ref_pass: Callable  # (reference params, batch) -> (logps, entropy) [N, T]
    chain: Callable  # (scored, transform_state, entropy=None, kl=None) -> (batch, rollouts, state)
    trained_groups: Callable  # (scored, transform_state) -> bool[P]
    update: Callable  # (state, batch, frozen) -> (state, metrics), state donated
    token_kl: Callable  # (logps, ref_logps, weights) [N, T] -> per-token KL, 0 off the mask
    # (params, prompts, mask, key, engine.Prefix) -> (Rollout, done, EngineStats): the
    # partial-rollout sampler, or None when partial rollouts are off.
    partial_generate: Callable | None = None
    lora: bool = False  # whether the policy carries LoRA adapters
    loss: LossConfig | None = None  # the update's loss options

    def split(self, params) -> tuple[Any, Any]:
        """(trained, frozen) parts of the policy params: (adapters, base) under LoRA,
        else (params, {})."""
        return lora.split(params) if self.lora else (params, {})

    def policy(self, state: TrainState, frozen) -> Any:
        """The policy params of `state` (no copy: a dict union under LoRA)."""
        return lora.combine(state.params, frozen) if self.lora else state.params


def _traced_under_rules(fn, mesh, rules):
    """`fn` whose tracing runs with the model's logical-axis rules active."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with sharding.with_rules(mesh, rules):
            return fn(*args, **kwargs)

    return wrapped


def build_stages(
    *,
    model: ModelConfig,
    sampling: SamplingConfig,
    greedy: SamplingConfig,
    eval_sampling: SamplingConfig,
    loss: LossConfig,
    chain: RolloutTransform,
    optimizer: optax.GradientTransformation,
    group_size: int,
    mesh: jax.sharding.Mesh,
    rules: Sequence[tuple[str, Any]],
    load_params: Callable[[Any], Any] | None = None,
    seed: int = 0,
    lora_targets: Sequence[str] = (),
    engine: str = "static",
    slots: int = 0,
    kl_kind: str = "k1",
    partial_stop_groups: int = 0,
) -> Stages:
    """Jits every stage of the run over `mesh` (see the module docstring).

    `load_params(abstract)` returns the initial (base) params placed like `abstract` (a
    pytree of `jax.ShapeDtypeStruct`s with shardings); None = random init from `seed`.

    With `model.lora_rank > 0`, LoRA adapters (`models.lora`) are created for
    `lora_targets` beside the base weights: the policy is base + adapters, the update
    trains the adapters only (`TrainState.params` holds them, the base is its `frozen`
    argument), the samplers decode with the adapters merged into the weights, and
    `ref_pass` scores with the base alone.

    `engine="continuous"` makes the training sampler (`generate`) the continuous-batching
    engine (`jaxrl_llm.engine`) with `slots` decode slots (0 = all rows at once); greedy
    and evaluation sampling stay static. `partial_stop_groups = P > 0` also builds
    `partial_generate` (`engine.make_partial_generate_fn`, stopping once P groups of
    `group_size` are complete).
    """
    rules = tuple((name, axes) for name, axes in rules)
    rows = sharding.batch_sharding(mesh, rules, 1)  # P(batch axes): any rank >= 1
    rep = sharding.replicated(mesh)
    init_key = jax.random.fold_in(jax.random.key(seed), 1)
    use_lora = model.lora_rank > 0
    lora_key = jax.random.fold_in(jax.random.key(seed), 3)

    def placed(abstract, axes):
        shardings = sharding.tree_shardings(axes, abstract, mesh, rules)
        return shardings, jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
        )

    base_sh, base_abstract = placed(
        jax.eval_shape(lambda: init_params(model, init_key)), param_logical_axes(model)
    )
    if load_params is None:
        make_base = jax.jit(lambda: init_params(model, init_key), out_shardings=base_sh)
    else:
        make_base = functools.partial(load_params, base_abstract)
    if use_lora:
        targets = lora.check_targets(lora_targets)
        adapter_sh, adapter_abstract = placed(
            jax.eval_shape(lambda: lora.init_adapters(model, lora_key, targets)),
            lora.adapter_logical_axes(model, targets),
        )
        make_adapters = jax.jit(
            lambda: lora.init_adapters(model, lora_key, targets), out_shardings=adapter_sh
        )
        param_sh = lora.combine(adapter_sh, base_sh)
        trained_sh, frozen_sh, trained_abstract = adapter_sh, base_sh, adapter_abstract

        def make_params():
            return lora.combine(make_adapters(), make_base())
    else:
        param_sh, make_params = base_sh, make_base
        trained_sh, frozen_sh, trained_abstract = base_sh, {}, base_abstract
    opt_sh = sharding.opt_state_shardings(
        optimizer, jax.eval_shape(optimizer.init, trained_abstract), trained_sh, mesh
    )
    opt_init = jax.jit(optimizer.init, in_shardings=(trained_sh,), out_shardings=opt_sh)

    def init_state(params, transform_state) -> TrainState:
        rng = jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 2))
        return TrainState(
            step=replicate(np.zeros((), np.int32), rep),
            params=params,
            opt_state=opt_init(params),
            rng=replicate(rng, rep),
            transform_state=replicate(transform_state, rep),
        )

    state_sh = TrainState(
        step=rep, params=trained_sh, opt_state=opt_sh, rng=rep, transform_state=rep
    )

    def jit(fn, **kw):
        return jax.jit(_traced_under_rules(fn, mesh, rules), **kw)

    def sampler(s: SamplingConfig, engine: str = "static"):
        static = make_generate_fn(model, s) if engine == "static" else None

        def generate(params, prompts, mask, key_data):  # raw key data: replicable as an array
            # Adapters are folded into the weights once per call: decoding then runs one
            # (fused) matmul per projection, as without LoRA.
            params = lora.merge(params, model)
            key = jax.random.wrap_key_data(key_data)
            if static is not None:
                return static(params, prompts, mask, key)
            n, lp = prompts.shape
            fn = make_continuous_generate_fn(model, s, slots=slots or n, prompt_len=lp)
            return fn(params, prompts, mask, key)

        return jit(generate, in_shardings=(param_sh, rows, rows, rep), out_shardings=rows)

    def partial_sampler():
        def generate(params, prompts, mask, key_data, prefix):
            params = lora.merge(params, model)
            n, lp = prompts.shape
            fn = make_partial_generate_fn(
                model,
                sampling,
                slots=slots or n,
                prompt_len=lp,
                group_size=group_size,
                stop_groups=partial_stop_groups,
            )
            return fn(params, prompts, mask, jax.random.wrap_key_data(key_data), prefix)

        return jit(
            generate,
            in_shardings=(param_sh, rows, rows, rep, rows),
            out_shardings=(rows, rows, rep),
        )

    temperature = loss.temperature

    def scorer(shardings):
        return jit(
            lambda params, batch: completion_logps(params, model, batch, temperature),
            in_shardings=(shardings, rows),
            out_shardings=rows,
        )

    policy_pass = scorer(param_sh)
    ref_pass = scorer(base_sh) if use_lora else policy_pass
    # Rollouts [P, G, ...] and group flags are small: replicated, whatever P is.
    chain_jit = jit(
        functools.partial(apply_chain, chain, group_size),
        in_shardings=(rows, rep, rows, rows),
        out_shardings=(rows, rep, rep),
    )

    def chain_fn(scored, transform_state, entropy=None, kl=None):
        return chain_jit(scored, transform_state, entropy, kl)

    groups_fn = jit(
        functools.partial(trained_groups, chain, group_size),
        in_shardings=(rows, rep),
        out_shardings=rep,
    )
    update = jit(
        make_train_step(model, loss, optimizer),
        in_shardings=(state_sh, rows, frozen_sh),
        out_shardings=(state_sh, rep),
        donate_argnums=0,
    )
    return Stages(
        mesh=mesh,
        rules=rules,
        rows=rows,
        replicated=rep,
        param_shardings=param_sh,
        frozen_shardings=frozen_sh,
        state_shardings=state_sh,
        init_params=make_params,
        init_state=init_state,
        generate=sampler(sampling, engine),
        greedy=sampler(greedy),
        eval_generate=sampler(eval_sampling),
        to_batch=jit(rollouts_to_batch, in_shardings=(rows, rows, rows), out_shardings=rows),
        policy_pass=policy_pass,
        ref_pass=ref_pass,
        loss=loss,
        chain=chain_fn,
        trained_groups=groups_fn,
        update=update,
        token_kl=jit(
            lambda lp, ref, w: losses.kl_penalty(lp, ref, kl_kind) * (w > 0),
            in_shardings=(rows, rows, rows),
            out_shardings=rows,
        ),
        partial_generate=partial_sampler() if partial_stop_groups else None,
        lora=use_lora,
    )
