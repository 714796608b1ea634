"""Jitted batched generation: prefill, then KV-cache decoding inside one `lax.while_loop`.

`generate` validates its inputs eagerly (clear one-line errors, before any compilation)
and then runs a single compiled program. `make_generate_fn` returns the underlying pure
function `(params, prompts, prompt_mask, key) -> Rollout` for callers that want to wrap
it in `jax.jit` with their own shardings.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm.models import (
    KVCache,
    ModelConfig,
    Params,
    hidden_states,
    init_cache,
    positions_from_mask,
    split_layers,
    unembed,
)
from jaxrl_llm.models.transformer import rope_sets


@flax.struct.dataclass
class Rollout:
    """Sampled completions for a batch of prompts.

    Completion column t is the t-th generated token. A row stops after its first EOS
    token (which is included in the completion); later columns hold `pad_id`, a False
    mask and zero log-probs.
    """

    tokens: jax.Array  # [B, T] int32, completion tokens, pad_id after EOS
    # [B, T] float32: log softmax(logits / temperature)[token], the full (unfiltered)
    # temperature-scaled policy; equals `models.token_logps(..., temperature)` of the
    # concatenated prompt + completion. At temperature 0 (greedy): log softmax(logits).
    logps: jax.Array
    # [B, T] float32: log-prob under the distribution actually sampled from, i.e. after
    # temperature, top-k and top-p, renormalized. Equals `logps` when top_k == 0 and
    # top_p == 1; 0 at temperature 0 (a point mass).
    sampling_logps: jax.Array
    completion_mask: jax.Array  # [B, T] bool, True up to and including EOS
    lengths: jax.Array  # [B] int32, number of completion tokens (= completion_mask.sum(-1))
    truncated: jax.Array  # [B] bool, True if no EOS was produced within T tokens
    prompt_lengths: jax.Array  # [B] int32, number of real (unpadded) prompt tokens


def sample_logits(
    logits: jax.Array,
    key: jax.Array,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draws one token per row from filtered, temperature-scaled logits.

    z = logits / temperature. top-k keeps tokens with z >= the k-th largest z; top-p
    (nucleus) then keeps the smallest set of most-probable tokens whose probability under
    softmax(z restricted to the kept set) reaches top_p (at least the argmax). Ties at a
    threshold are all kept. The token is drawn from the renormalized kept set.

    Args:
      logits: [B, V] float32.
      key: PRNG key.
      temperature: >= 0; 0 means greedy (argmax, no randomness).
      top_k: 0 disables; else 1 <= top_k <= V.
      top_p: in (0, 1]; 1 disables.
    Returns:
      (tokens [B] int32, logps [B] = log softmax(z)[token] (temperature 1 when greedy),
       sampling_logps [B] = log-prob under the filtered distribution; 0 when greedy).
    """
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        logps = jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
        return tokens, logps, jnp.zeros_like(logps)

    z = logits / temperature
    logp_all = jax.nn.log_softmax(z, axis=-1)
    filtered = z
    if top_k:
        kth = lax.top_k(z, top_k)[0][:, -1:]  # [B, 1]
        filtered = jnp.where(z >= kth, filtered, -jnp.inf)
    if top_p < 1.0:
        probs = jax.nn.softmax(filtered, axis=-1)
        sorted_probs = -jnp.sort(-probs, axis=-1)  # descending
        # Keep a token if the mass strictly above it is < top_p: the minimal nucleus.
        mass_above = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_above < top_p
        cutoff = jnp.min(jnp.where(keep_sorted, sorted_probs, jnp.inf), axis=-1, keepdims=True)
        filtered = jnp.where(probs >= cutoff, filtered, -jnp.inf)
    tokens = jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
    logps = jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
    if filtered is z:
        sampling_logps = logps
    else:
        sampling_logp_all = jax.nn.log_softmax(filtered, axis=-1)
        sampling_logps = jnp.take_along_axis(sampling_logp_all, tokens[:, None], axis=-1)[:, 0]
    return tokens, logps, sampling_logps


def _generate(
    params: Params,
    prompts: jax.Array,
    prompt_mask: jax.Array,
    key: jax.Array,
    *,
    config: ModelConfig,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    eos_ids: tuple[int, ...],
    pad_id: int,
    cache_size: int,
    kv_buckets: int,
    row_groups: int,
) -> Rollout:
    """The traced program behind `generate` (no validation; see `generate` for the spec)."""
    b, lp = prompts.shape
    t_max = max_new_tokens
    prompt_mask = prompt_mask.astype(bool)
    prompts = prompts.astype(jnp.int32)
    prompt_lengths = jnp.sum(prompt_mask, axis=-1, dtype=jnp.int32)  # [B]
    sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    eos = jnp.asarray(eos_ids, jnp.int32) if eos_ids else None

    # Decode steps 1..T-1 run as consecutive phases; phase [a, b) uses a cache of
    # exactly Lp + b - 1 slots (all it can reach), grown by padding between phases.
    # Decoding is memory-bound (each step reads the whole cache), so early steps
    # should not stream slots that are still empty. Phase sizes are static.
    n_steps = t_max - 1
    n_phases = max(1, min(kv_buckets, n_steps))
    bounds = [1 + (n_steps * j) // n_phases for j in range(n_phases + 1)]
    sizes = [min(lp + end - 1, cache_size) for end in bounds[1:]]

    # Slots [0, Lp) hold the (left-padded) prompt, slot Lp + i the i-th completion token.
    # Future slots are marked valid up front: the causal mask hides them until written.
    kv_valid = jnp.concatenate([prompt_mask, jnp.ones((b, cache_size - lp), bool)], axis=1)
    params = split_layers(params, fuse=True)  # once, outside the loops
    # RoPE sin/cos of every position a decode step can feed, computed once: gathering a
    # row per step is much cheaper than recomputing sin/cos inside each fused layer op.
    # One (sin, cos) table per RoPE base the layers use (two for Gemma 3's local layers).
    rope_tabs = rope_sets(jnp.arange(lp + t_max)[None], config)  # each [1, P, 1, H/2]
    cache = init_cache(config, b, sizes[0])
    h, cache = hidden_states(
        params, config, prompts, positions_from_mask(prompt_mask), kv_valid[:, : sizes[0]], cache, 0
    )
    logits = unembed(params, config, h[:, -1])  # [B, V]: only the last position is needed
    # Row groups: each decodes its rows through the whole trunk with its own cache, so
    # a decode step is `row_groups` independent chains of ops (see default_row_groups).
    rows = b // row_groups
    groups = [slice(j * rows, (j + 1) * rows) for j in range(row_groups)]
    cache = tuple(jax.tree.map(lambda a, g=g: a[g], cache) for g in groups)

    def record(carry, i, logits):
        tokens, logps, slogps, mask, done, cache = carry
        tok, lpi, slpi = sample(logits, jax.random.fold_in(key, i))
        active = ~done
        tok = jnp.where(active, tok, pad_id)
        tokens = lax.dynamic_update_index_in_dim(tokens, tok, i, axis=1)
        logps = lax.dynamic_update_index_in_dim(logps, jnp.where(active, lpi, 0.0), i, 1)
        slogps = lax.dynamic_update_index_in_dim(slogps, jnp.where(active, slpi, 0.0), i, 1)
        mask = lax.dynamic_update_index_in_dim(mask, active, i, axis=1)
        if eos is not None:
            done = done | (active & jnp.any(tok[:, None] == eos[None, :], axis=-1))
        return tokens, logps, slogps, mask, done, cache

    carry = (
        jnp.full((b, t_max), pad_id, jnp.int32),
        jnp.zeros((b, t_max), jnp.float32),
        jnp.zeros((b, t_max), jnp.float32),
        jnp.zeros((b, t_max), bool),
        jnp.zeros((b,), bool),
        cache,
    )
    carry = record(carry, 0, logits)

    def decode_phase(i0, carry, end, size):
        """Steps i0..end-1; step i feeds token i-1 at slot Lp+i-1 and samples token i."""
        valid = kv_valid[:, :size]

        def cond(state):
            i, carry = state
            return (i < end) & ~jnp.all(carry[4])

        def body(state):
            i, carry = state
            tokens, cache = carry[0], carry[5]
            prev = lax.dynamic_index_in_dim(tokens, i - 1, axis=1)  # [B, 1]
            pos = (prompt_lengths + i - 1)[:, None]
            ropes = tuple((st[0, pos], ct[0, pos]) for st, ct in rope_tabs)  # [B, 1, 1, H/2]
            outs = [
                hidden_states(
                    params,
                    config,
                    prev[g],
                    pos[g],
                    valid[g],
                    c,
                    lp + i - 1,
                    tuple((sn[g], cs[g]) for sn, cs in ropes),
                )
                for g, c in zip(groups, cache, strict=True)
            ]
            cache = tuple(c for _, c in outs)
            h = outs[0][0] if row_groups == 1 else jnp.concatenate([h for h, _ in outs], axis=0)
            logits = unembed(params, config, h[:, 0])
            return i + 1, record((*carry[:5], cache), i, logits)

        return lax.while_loop(cond, body, (i0, carry))

    state = (jnp.asarray(1, jnp.int32), carry)
    for end, size in zip(bounds[1:], sizes, strict=True):
        i, carry = state
        cache = carry[5]
        grow = size - cache[0].max_length
        if grow:
            cache = tuple(
                KVCache(
                    k=tuple(jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, grow))) for a in c.k),
                    v=tuple(jnp.pad(a, ((0, 0), (0, 0), (0, grow), (0, 0))) for a in c.v),
                )
                for c in cache
            )
        state = decode_phase(i, (*carry[:5], cache), end, size)
    carry = state[1]
    tokens, logps, slogps, mask, done, _ = carry
    return Rollout(
        tokens=tokens,
        logps=logps,
        sampling_logps=slogps,
        completion_mask=mask,
        lengths=jnp.sum(mask, axis=-1, dtype=jnp.int32),
        truncated=~done,
        prompt_lengths=prompt_lengths,
    )


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static options of one compiled sampler (hashable: jit and caches key on it).

    Greedy or evaluation sampling is `sampling.replace(temperature=0.0)`, not another
    option list. Field checks that need no model run here; ids are checked against the
    vocabulary by `make_generate_fn` / `generate`.
    """

    max_new_tokens: int  # T, the completion buffer
    temperature: float = 1.0  # >= 0; 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # in (0, 1]; 1 = off
    eos_ids: tuple[int, ...] = ()  # any of them ends a completion (kept in it)
    pad_id: int = 0  # written after a row's EOS
    cache_size: int | None = None  # KV slots; default Lp + T
    kv_buckets: int = 4  # decode phases, each reading only the cache prefix it can reach
    row_groups: int | None = None  # independent row groups; None = default_row_groups

    def __post_init__(self):
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))
        t = self.max_new_tokens
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {t!r}")
        if not self.temperature >= 0:
            raise ValueError(
                f"generate: temperature must be >= 0 (0 = greedy), got {self.temperature}"
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"generate: top_k must be an int >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"generate: top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.kv_buckets, int) or self.kv_buckets < 1:
            raise ValueError(f"generate: kv_buckets must be an int >= 1, got {self.kv_buckets!r}")
        g = self.row_groups
        if g is not None and (not isinstance(g, int) or g < 1):
            raise ValueError(f"generate: row_groups must be an int >= 1 or None, got {g!r}")

    def replace(self, **changes) -> SamplingConfig:
        return dataclasses.replace(self, **changes)

    def check(self, config: ModelConfig, prompt_len: int | None = None) -> None:
        """Raises a one-line ValueError for ids outside the vocab or a too-small cache."""
        v = config.vocab_size
        if self.top_k > v:
            raise ValueError(
                f"generate: top_k must be an int in [0, vocab_size={v}], got {self.top_k!r}"
            )
        for e in self.eos_ids:
            if not 0 <= e < v:
                raise ValueError(f"generate: eos id {e} is outside the vocab [0, {v})")
        if not 0 <= int(self.pad_id) < v:
            raise ValueError(f"generate: pad_id {self.pad_id} is outside the vocab [0, {v})")
        if prompt_len is not None and self.cache_size is not None:
            _check_buffer(prompt_len, self.max_new_tokens, self.cache_size)


def _sampling(sampling: SamplingConfig | None, options: dict) -> SamplingConfig:
    if sampling is None:
        return SamplingConfig(**options)
    if options:
        raise ValueError(f"generate: give a SamplingConfig or options, not both: {sorted(options)}")
    return sampling


def make_generate_fn(
    config: ModelConfig,
    sampling: SamplingConfig | None = None,
    *,
    prompt_len: int | None = None,
    **options,
) -> Callable[[Params, jax.Array, jax.Array, jax.Array], Rollout]:
    """The pure (un-jitted) generation function for fixed static options.

    Returns f(params, prompts [B, Lp], prompt_mask [B, Lp], key) -> Rollout, suitable
    for `jax.jit(f, in_shardings=..., out_shardings=...)`. `sampling` is a
    `SamplingConfig` (or give its fields as keyword arguments). Options are validated
    here; the cache size (default Lp + max_new_tokens) must be >= Lp + max_new_tokens,
    checked against `prompt_len` when given, else at trace time.
    """
    s = _sampling(sampling, options)
    s.check(config, prompt_len)

    def generate_fn(params, prompts, prompt_mask, key):
        b, lp = prompts.shape
        size = lp + s.max_new_tokens if s.cache_size is None else s.cache_size
        _check_buffer(lp, s.max_new_tokens, size)
        groups = (
            default_row_groups(b // jax.device_count()) if s.row_groups is None else s.row_groups
        )
        if b % groups:
            raise ValueError(f"generate: row_groups {groups} does not divide the batch of {b}")
        return _generate(
            params,
            prompts,
            prompt_mask,
            key,
            config=config,
            max_new_tokens=s.max_new_tokens,
            temperature=float(s.temperature),
            top_k=int(s.top_k),
            top_p=float(s.top_p),
            eos_ids=s.eos_ids,
            pad_id=int(s.pad_id),
            cache_size=size,
            kv_buckets=s.kv_buckets,
            row_groups=groups,
        )

    return generate_fn


def default_row_groups(rows_per_device: int) -> int:
    """Row groups `make_generate_fn` uses when not told: 2 on a CPU device that owns
    several cores and at least 128 (an even number of) rows, else 1.

    On CPU a decode step is a chain of small ops, several of them single-threaded
    (attention reductions over the cache, cache updates, norms) and matmuls of B rows
    that do not keep two cores busy; two halves of the batch, each through the whole
    trunk with its own cache, are two independent chains the runtime overlaps on two
    cores. Measured on a 2-core machine (`benchmarks/sampler.py`, batch 256, one
    device): 13.0k -> 14.2k tokens/s; splitting only the attention gained nothing, and
    4 groups of 64 rows lose to 2 of 128. When the cores are already split into
    devices (`--xla_force_host_platform_device_count`, batch sharded), or on
    accelerators, which run each op on the whole chip: 1.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    per_device = (cores or 1) / max(1, jax.local_device_count())
    if jax.default_backend() == "cpu" and per_device >= 2:
        if rows_per_device >= 128 and rows_per_device % 2 == 0:
            return 2
    return 1


def _check_buffer(prompt_len: int, max_new_tokens: int, cache_size: int) -> None:
    if prompt_len + max_new_tokens > cache_size:
        raise ValueError(
            f"generate: prompt length {prompt_len} + max_new_tokens {max_new_tokens} "
            f"exceeds the KV buffer of {cache_size} slots"
        )


@functools.lru_cache(maxsize=64)
def _jitted(config: ModelConfig, sampling: SamplingConfig):
    return jax.jit(make_generate_fn(config, sampling))


def generate(
    params: Params,
    config: ModelConfig,
    prompts: jax.Array,
    prompt_mask: jax.Array,
    key: jax.Array,
    sampling: SamplingConfig | None = None,
    **options,
) -> Rollout:
    """Samples up to `max_new_tokens` tokens per prompt in one compiled program.

    The prompts are prefilled into a preallocated KV cache of `cache_size` slots
    (default Lp + T); then a `lax.while_loop` decodes one token per step for every row
    and exits once every row has produced an EOS id or T tokens. RoPE positions follow
    the left padding: position = cumsum(prompt_mask) - 1, continuing at
    prompt_length + t for completion token t. The same key gives the same rollout.

    Which log-probs are returned (see `Rollout`): `logps` is log softmax(logits / T) at
    the sampled token, the temperature-scaled policy without top-k/top-p, because that
    is what the trainer recomputes (`token_logps(..., temperature)`) as the
    importance-ratio denominator; `sampling_logps` is the log-prob under the
    filtered, renormalized distribution the token was actually drawn from, for callers
    that correct for the filtering. With top_k = 0 and top_p = 1 both are equal.

    Args:
      params: model parameters (`models.init_params` or imported).
      config: static model config.
      prompts: [B, Lp] int token ids, LEFT-padded.
      prompt_mask: [B, Lp] bool, True at real prompt tokens (a suffix of each row).
      key: PRNG key.
      sampling: a `SamplingConfig`, or its fields as keyword arguments:
      max_new_tokens: T, the completion buffer length.
      temperature: >= 0; 0 = greedy.
      top_k: 0 = off, else keep the k most likely tokens (1 == greedy).
      top_p: nucleus mass in (0, 1]; 1 = off.
      eos_ids: token ids that end a completion (may be empty: always T tokens).
      pad_id: token written after a row's EOS.
      cache_size: KV buffer slots; >= Lp + T.
      kv_buckets: the decode loop runs as this many consecutive phases, each attending
        only to the cache prefix it can reach; more phases read less of the cache
        (decoding is memory-bound on CPU) but compile the step more times.
      row_groups: decode the batch as this many independent groups of rows (each with
        its own cache), which the CPU runtime overlaps on its cores; must divide B.
        None = `default_row_groups(B)`. Results do not depend on it.
    Returns:
      `Rollout` with [B, T] completion arrays and [B] summaries.
    Raises:
      ValueError: empty batch, row_groups not dividing B, shape mismatch, a prompt not
        left-padded or empty, a prompt that does not fit the buffer, ids outside the
        vocab, temperature < 0, top_p outside (0, 1], top_k outside [0, V]; all before
        compiling.
    """
    if prompts.ndim != 2:
        raise ValueError(f"generate: prompts must be [B, Lp], got shape {prompts.shape}")
    if prompts.shape != prompt_mask.shape:
        raise ValueError(
            f"generate: prompt_mask shape {prompt_mask.shape} != prompts shape {prompts.shape}"
        )
    b, lp = prompts.shape
    if b == 0:
        raise ValueError("generate: empty batch (B == 0)")
    if lp == 0:
        raise ValueError("generate: empty prompts (Lp == 0); give at least one token (e.g. BOS)")
    s = _sampling(sampling, options)
    s.check(config, lp)
    if not isinstance(prompt_mask, jax.core.Tracer) and not isinstance(prompts, jax.core.Tracer):
        m = np.asarray(prompt_mask).astype(bool)
        if not m.any(axis=1).all():
            raise ValueError(
                f"generate: prompt rows {np.flatnonzero(~m.any(1)).tolist()} are empty"
            )
        # Left padding: once a row's real tokens start, they continue to the end.
        if (m[:, :-1] & ~m[:, 1:]).any():
            bad = np.flatnonzero((m[:, :-1] & ~m[:, 1:]).any(1)).tolist()
            raise ValueError(f"generate: prompt_mask rows {bad} are not left-padded")
        p = np.asarray(prompts)
        if ((p < 0) | (p >= config.vocab_size))[m].any():
            raise ValueError(
                f"generate: prompt token ids outside the vocab [0, {config.vocab_size})"
            )
    fn = _jitted(config, s)
    return fn(params, prompts, prompt_mask, key)
