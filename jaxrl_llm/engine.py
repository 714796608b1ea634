"""Continuous-batching sampler: S decode slots serve a queue of R requests inside one
compiled program; a slot whose completion ends is refilled with the next queued prompt
(batched prefills into the freed slots' cache rows), and once the queue is empty the live
rows are compacted into narrower batches, so short completions stop costing decode rows
while the longest one finishes.

`make_continuous_generate_fn` is a drop-in for `sampler.make_generate_fn` (same
`SamplingConfig`, same `Rollout`, rows in request order) when completion lengths vary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm.models import (
    KVCache,
    ModelConfig,
    Params,
    hidden_states,
    init_cache,
    positions_from_mask,
    rope_sets,
    split_layers,
    unembed,
)
from jaxrl_llm.sampler import Rollout, SamplingConfig, sample_logits


@flax.struct.dataclass
class EngineStats:
    """Work counters of one continuous-batching run (all scalars)."""

    decode_steps: jax.Array  # [] int32, loop iterations: one sampled token per busy slot
    useful_tokens: jax.Array  # [] int32, completion tokens returned (= sum of lengths)
    prefills: jax.Array  # [] int32, requests admitted into a slot (R when all are served)
    decoded_rows: jax.Array  # [] int32, rows decoded summed over steps (the batch width each)
    slot_utilization: jax.Array  # [] float32, useful_tokens / decoded_rows
    slots: int = flax.struct.field(pytree_node=False)  # S, decode slots used


# Once the queue is empty the decode batch is halved (compacting the live slots) each time
# the live rows fit in half of it, down to this many rows: below it a step's fixed cost
# dominates and compaction buys little.
MIN_WIDTH = 8


def batch_widths(slots: int) -> list[int]:
    """The static ladder of decode batch widths: S, ceil(S/2), ... while >= MIN_WIDTH."""
    widths = [slots]
    while (widths[-1] + 1) // 2 >= MIN_WIDTH:
        widths.append((widths[-1] + 1) // 2)
    return widths


def kv_sizes(prompt_len: int, max_new_tokens: int, kv_buckets: int) -> list[int]:
    """Cache widths of the lock-step phases: phase j holds completion tokens t < T j / n."""
    n = max(1, min(kv_buckets, max_new_tokens))
    return [prompt_len + (max_new_tokens * j) // n for j in range(1, n + 1)]


@flax.struct.dataclass
class Prefix:
    """Completion tokens already sampled for each request (partial rollouts, APRIL).

    A request with `lengths[i] = k > 0` continues at completion token k: its prompt and
    its k tokens are prefilled under the current parameters, and the k log-probs it came
    with (those of the policies that sampled them) are returned unchanged. A request with
    `done[i]` is complete already and is not decoded again.
    """

    tokens: jax.Array  # int32[R, T] completion tokens so far (pad after lengths)
    logps: jax.Array  # float32[R, T] their log-probs (Rollout.logps contract)
    sampling_logps: jax.Array  # float32[R, T]
    lengths: jax.Array  # int32[R] k, tokens so far
    done: jax.Array  # bool[R] already complete (EOS or budget)
    eos: jax.Array  # bool[R] ended with EOS

    @classmethod
    def empty(cls, requests: int, max_new_tokens: int, pad_id: int = 0) -> Prefix:
        """No tokens for any of `requests` requests (a fresh batch)."""
        r, t = requests, max_new_tokens
        return cls(
            tokens=jnp.full((r, t), pad_id, jnp.int32),
            logps=jnp.zeros((r, t), jnp.float32),
            sampling_logps=jnp.zeros((r, t), jnp.float32),
            lengths=jnp.zeros((r,), jnp.int32),
            done=jnp.zeros((r,), bool),
            eos=jnp.zeros((r,), bool),
        )


def _widen(ks: tuple, vs: tuple, width: int) -> tuple[tuple, tuple]:
    """Cache buffers padded to `width` slots per row: k [M, K, H, C], v [M, K, C, H]."""
    grow = width - ks[0].shape[-1]
    if not grow:
        return ks, vs
    ks = tuple(jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, grow))) for a in ks)
    return ks, tuple(jnp.pad(a, ((0, 0), (0, 0), (0, grow), (0, 0))) for a in vs)


def request_key(key: jax.Array, request: jax.Array, t: jax.Array) -> jax.Array:
    """The key of completion token t of request `request`: fold_in(fold_in(key, request), t).

    Depending on (request, t) only, not on the slot or the loop step, makes a rollout
    independent of the number of slots and of the order in which requests are served.
    """
    return jax.random.fold_in(jax.random.fold_in(key, request), t)


def _continuous_generate(
    params: Params,
    prompts: jax.Array,
    prompt_mask: jax.Array,
    key: jax.Array,
    max_lengths: jax.Array | None,
    prefix: Prefix | None = None,
    *,
    config: ModelConfig,
    slots: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    eos_ids: tuple[int, ...],
    pad_id: int,
    group_size: int = 1,
    stop_groups: int = 0,
    kv_buckets: int = 1,
) -> tuple[Rollout, EngineStats, jax.Array]:
    """The traced program behind `make_continuous_generate_fn` and
    `make_partial_generate_fn` (see there for the spec); also returns done bool[R]."""
    r, lp = prompts.shape
    n, t_max = slots, max_new_tokens
    size = lp + t_max  # cache slots of one row: [0, Lp) prompt, Lp + t completion token t
    prompts = prompts.astype(jnp.int32)
    prompt_mask = prompt_mask.astype(bool)
    prompt_lengths = jnp.sum(prompt_mask, axis=-1, dtype=jnp.int32)  # [R]
    positions = positions_from_mask(prompt_mask)  # [R, Lp]
    if max_lengths is None:
        budgets = jnp.full((r,), t_max, jnp.int32)
    else:
        budgets = jnp.clip(jnp.asarray(max_lengths, jnp.int32), 1, t_max)  # [R]
    eos = jnp.asarray(eos_ids, jnp.int32) if eos_ids else None
    sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    params = split_layers(params, fuse=True)  # once, outside the loops
    rope_tabs = rope_sets(jnp.arange(lp + t_max)[None], config)  # each [1, P, 1, H/2]
    future = jnp.ones((size - lp,), bool)  # completion slots: hidden by causality until written

    def prefill(rows: jax.Array, with_prefix: bool = True) -> tuple[jax.Array, KVCache]:
        """Logits of the next token [M, V] and the cache of rows [M]: the prompt's Lp slots,
        or with a prefix all Lp + T (prompt and the completion tokens so far)."""
        if prefix is None or not with_prefix:
            cache = init_cache(config, rows.shape[0], lp)
            h, cache = hidden_states(
                params, config, prompts[rows], positions[rows], prompt_mask[rows], cache, 0
            )
            return unembed(params, config, h[:, -1]), cache
        k = prefix.lengths[rows]
        tokens = jnp.concatenate([prompts[rows], prefix.tokens[rows]], axis=1)
        mask = jnp.concatenate([prompt_mask[rows], jnp.arange(t_max)[None] < k[:, None]], 1)
        cache = init_cache(config, rows.shape[0], size)
        h, cache = hidden_states(params, config, tokens, positions_from_mask(mask), mask, cache, 0)
        last = jnp.take_along_axis(h, (lp + k - 1)[:, None, None], axis=1)[:, 0]  # [M, D]
        return unembed(params, config, last), cache

    def sample_row(logits, request, t):
        tok, logp, slogp = sample(logits[None], request_key(key, request, t))
        return tok[0], logp[0], slogp[0]

    # Refill admits queued requests in batches: each iteration prefills the largest size
    # of this static ladder (1, 4, 16, ..., S) that fits both the free slots and the queue,
    # so a wave of rows ending together costs one batched prefill, not one per row.
    ladder = sorted({min(4**i, n) for i in range(n.bit_length())} | {n})

    # Lock-step: every request is prefilled at step 0 with no prefix (S = R), so every
    # live row is at completion token `step`, a scalar cache index for the whole batch
    # (one contiguous write per layer) and cache widths that grow with the step.
    lockstep = prefix is None and n == r

    def decode(ks, vs, valid, tok, t, plen, step):
        """All slots at once: slot s feeds its completion token t[s] (cache slot Lp + t[s],
        position plen[s] + t[s]); one batched trunk call with per-row cache indices (or
        the lock-step's scalar one)."""
        pos = (plen + t)[:, None]  # [S, 1]
        ropes = tuple((sn[0, pos], cs[0, pos]) for sn, cs in rope_tabs)  # [S, 1, 1, H/2]
        index = lp + (step if lockstep else t)
        h, cache = hidden_states(
            params, config, tok[:, None], pos, valid, KVCache(k=ks, v=vs), index, ropes
        )
        return unembed(params, config, h[:, 0]), cache.k, cache.v

    # Requests are served in index order, those with a prefix first, skipping those
    # already done; queue[j] is the j-th to serve, `todo` how many there are and the first
    # `resumed` of them have a prefix.
    done0 = jnp.zeros((r,), bool) if prefix is None else prefix.done.astype(bool)
    k0 = jnp.zeros((r,), jnp.int32) if prefix is None else prefix.lengths.astype(jnp.int32)
    order = 2 * done0.astype(jnp.int32) + (k0 == 0)  # resumed, fresh, done
    queue = jnp.argsort(order, stable=True).astype(jnp.int32)
    todo = jnp.sum(~done0, dtype=jnp.int32)
    resumed = jnp.sum(~done0 & (k0 > 0), dtype=jnp.int32)
    # Slot s serves request req[s] (r = idle) and has sampled t[s] of its tokens; logits[s]
    # are the logits of its next token. The first S requests are prefilled as one batch.
    slot_ids = jnp.arange(n, dtype=jnp.int32)
    first = jnp.where(slot_ids < todo, queue[:n], r)
    logits, cache = prefill(jnp.minimum(first, r - 1), False)
    ks, vs = cache.k, cache.v  # [S, K, H, C] and [S, K, C, H], C = Lp
    if prefix is not None:
        # The resumed requests among the first S (slots [0, min(resumed, S))) are prefilled
        # again with their tokens, in batches of the `ladder` sizes: a handful of carried
        # rows costs a handful of Lp + T prefills, not S of them.
        ks, vs = _widen(ks, vs, size)

        def resume(m: int):
            def fn(state):
                j, logits, ks, vs = state
                row_logits, pc = prefill(lax.dynamic_slice_in_dim(first, j, m))
                at = (j, 0, 0, 0)
                ks = tuple(lax.dynamic_update_slice(a, p, at) for a, p in zip(ks, pc.k))
                vs = tuple(lax.dynamic_update_slice(a, p, at) for a, p in zip(vs, pc.v))
                return j + m, lax.dynamic_update_slice(logits, row_logits, (j, 0)), ks, vs

            return fn

        head = jnp.minimum(resumed, n)
        state = (jnp.asarray(0, jnp.int32), logits, ks, vs)
        for m in [2**i for i in reversed(range(n.bit_length()))]:  # head in binary
            state = lax.cond(head - state[0] >= m, resume(m), lambda c: c, state)
        _, logits, ks, vs = state
    valid = jnp.concatenate(
        [prompt_mask[jnp.minimum(first, r - 1)], jnp.ones((n, size - lp), bool)], axis=1
    )  # [S, C]
    if prefix is None:
        out = (
            jnp.full((r, t_max), pad_id, jnp.int32),  # tokens
            jnp.zeros((r, t_max), jnp.float32),  # logps
            jnp.zeros((r, t_max), jnp.float32),  # sampling_logps
            jnp.zeros((r, t_max), bool),  # completion_mask
            jnp.zeros((r,), bool),  # ended with EOS
        )
    else:
        out = (
            prefix.tokens.astype(jnp.int32),
            prefix.logps.astype(jnp.float32),
            prefix.sampling_logps.astype(jnp.float32),
            jnp.arange(t_max)[None] < k0[:, None],
            prefix.eos.astype(bool),
        )
    slot_state = (first, k0[jnp.minimum(first, r - 1)], logits, valid, ks, vs)

    def admit(m: int):
        def fn(free, nxt, slot_state):
            req, t, logits, valid, ks, vs = slot_state
            new = lax.dynamic_slice_in_dim(queue, nxt, m)  # next m queued requests
            if prefix is None:
                row_logits, pc = prefill(new)
            else:  # a prefix prefill only while resumed requests are queued

                def fresh(new):
                    row_logits, pc = prefill(new, False)
                    return row_logits, KVCache(*_widen(pc.k, pc.v, size))

                row_logits, pc = lax.cond(nxt < resumed, prefill, fresh, new)
            if m == 1:  # the common case with a length tail: a contiguous slice write
                slot = jnp.argmax(free).astype(jnp.int32)[None]
                at = (slot[0], 0, 0, 0)
                ks = tuple(lax.dynamic_update_slice(a, p, at) for a, p in zip(ks, pc.k))
                vs = tuple(lax.dynamic_update_slice(a, p, at) for a, p in zip(vs, pc.v))
            else:
                slot = jnp.argsort(~free, stable=True)[:m].astype(jnp.int32)  # first m free
                w = pc.k[0].shape[-1]  # Lp, or Lp + T with a prefix
                ks = tuple(a.at[slot, :, :, :w].set(p) for a, p in zip(ks, pc.k))
                vs = tuple(a.at[slot, :, :w, :].set(p) for a, p in zip(vs, pc.v))
            # The new occupant's prompt mask replaces the old one; the old completion
            # entries stay hidden by causality until this request overwrites them.
            rows_valid = jnp.concatenate(
                [prompt_mask[new], jnp.broadcast_to(future, (m, size - lp))], 1
            )
            valid = valid.at[slot].set(rows_valid)
            logits = logits.at[slot].set(row_logits)
            req, t = req.at[slot].set(new), t.at[slot].set(k0[new])
            return free.at[slot].set(False), nxt + m, (req, t, logits, valid, ks, vs)

        return fn

    def refill(free, nxt, slot_state):
        """Admits queued requests into the free slots (batched prefills, see `ladder`).

        One `while_loop` per ladder size, largest first (a `lax.switch` between sizes
        would copy the slot caches through the conditional)."""

        def fits(free, nxt):
            return jnp.minimum(jnp.sum(free, dtype=jnp.int32), todo - nxt)

        state = (free, nxt, slot_state)
        for m in reversed(ladder):
            state = lax.while_loop(
                lambda c, m=m: fits(c[0], c[1]) >= m, lambda c, m=m: admit(m)(*c), state
            )
        free, nxt, (req, *rest) = state
        return nxt, (jnp.where(free, r, req), *rest)  # no request left: the slot goes idle

    def complete_groups(done):
        return jnp.sum(jnp.all(done.reshape(-1, group_size), axis=-1), dtype=jnp.int32)

    def step_fn(refill_slots: bool):
        """One decode step of every slot; then ended slots are refilled from the queue
        (`refill_slots`) or go idle."""

        def body(state):
            step, decoded, nxt, slot_state, out, done = state
            req, t, logits, valid, ks, vs = slot_state
            width, kv = req.shape[0], ks[0].shape[-1]
            active = req < r
            tok, logp, slogp = jax.vmap(sample_row)(logits, req, t)  # [W] each
            tok = jnp.where(active, tok, pad_id)
            tokens, logps, slogps, mask, ended_eos = out
            # Idle slots have req = r: out of bounds, their writes are dropped.
            tokens = tokens.at[req, t].set(tok, mode="drop")
            logps = logps.at[req, t].set(logp, mode="drop")
            slogps = slogps.at[req, t].set(slogp, mode="drop")
            mask = mask.at[req, t].set(True, mode="drop")
            is_eos = jnp.zeros((width,), bool) if eos is None else jnp.any(tok[:, None] == eos, -1)
            ended_eos = ended_eos.at[req].set(is_eos, mode="drop")
            budget = budgets[jnp.minimum(req, r - 1)]
            end = active & (is_eos | (t + 1 >= budget))
            done = done.at[jnp.where(end, req, r)].set(True, mode="drop")
            plen = prompt_lengths[jnp.minimum(req, r - 1)]
            logits, ks, vs = decode(ks, vs, valid[:, :kv], tok, t, plen, step)
            t = jnp.where(active, t + 1, t)
            slot_state = (req, t, logits, valid, ks, vs)
            if refill_slots:
                nxt, slot_state = refill(end, nxt, slot_state)
            else:
                slot_state = (jnp.where(end, r, req), *slot_state[1:])
            out = (tokens, logps, slogps, mask, ended_eos)
            return step + 1, decoded + width, nxt, slot_state, out, done

        return body

    def phase_cond(refill_slots: bool, kv: int, next_width: int):
        """Whether the phase goes on: some slot busy, fewer than `stop_groups` groups
        complete, and the phase's own limits: a queued request (refill phase), every live
        row's next cache slot < kv, more live rows than the next width."""

        def cond(state):
            _, _, nxt, (req, t, *_), _, done = state
            active = req < r
            go = jnp.any(active)
            if stop_groups:
                go &= complete_groups(done) < stop_groups
            if refill_slots:
                go &= nxt < todo
            if kv < size:
                go &= jnp.max(jnp.where(active, t, 0)) < kv - lp
            if next_width:
                go &= jnp.sum(active, dtype=jnp.int32) > next_width
            return go

        return cond

    def resize(slot_state, width: int, kv: int):
        """The slot state for a phase of `width` slots and `kv` cache slots per row: live
        slots compacted to the front (their order does not matter, outputs go by request),
        the caches padded to kv."""
        req, t, logits, valid, ks, vs = slot_state
        if width < req.shape[0]:
            keep = jnp.argsort(req >= r, stable=True)[:width]
            req, t, logits, valid, ks, vs = jax.tree.map(
                lambda a: a[keep], (req, t, logits, valid, ks, vs)
            )
        return (req, t, logits, valid, *_widen(ks, vs, kv))

    # The phases, a static sequence (one compiled loop body each); a phase whose limits
    # already fail runs no step:
    #   1. refill (S < R): every slot busy while requests are queued, full-width caches;
    #   2. S slots, no refill: cache widths that grow with the step (lock-step only,
    #      `kv_buckets` phases as the static sampler's, each reading only what it can
    #      reach), else full width;
    #   3. narrower batches S/2, S/4, ...: once the live rows fit, they are compacted, so
    #      a length tail stops costing decode rows for the slots that went idle.
    widths = batch_widths(n)
    phases = []  # (refill, width, kv, next width or 0)
    if n < r:
        phases.append((True, n, size, 0))
    kvs = kv_sizes(lp, t_max, kv_buckets) if lockstep else [size]
    phases += [(False, n, kv, widths[1] if len(widths) > 1 else 0) for kv in kvs]
    phases += [(False, w, size, nw) for w, nw in zip(widths[1:], [*widths[2:], 0])]

    def run(i: int, state):
        """Phases i, i+1, ...; a later phase (and its resize, a copy of the caches) runs
        only if this one left work (`lax.cond`; the caches are not among its outputs)."""
        refill_slots, width, kv, next_width = phases[i]
        step, decoded, nxt, slot_state, out, done = state
        slot_state = resize(slot_state, width, kv)
        state = lax.while_loop(
            phase_cond(refill_slots, kv, next_width),
            step_fn(refill_slots),
            (step, decoded, nxt, slot_state, out, done),
        )
        if i + 1 == len(phases):
            return (*state[:3], *state[4:])
        active = state[3][0] < r
        more = jnp.any(active)
        if stop_groups:
            more &= complete_groups(state[5]) < stop_groups
        return lax.cond(more, lambda s: run(i + 1, s), lambda s: (*s[:3], *s[4:]), state)

    init = (jnp.asarray(0, jnp.int32), jnp.asarray(0, jnp.int32), jnp.minimum(todo, n))
    state = run(0, (*init, slot_state, out, done0))
    steps, decoded, admitted, out, done = state
    tokens, logps, slogps, mask, ended_eos = out
    lengths = jnp.sum(mask, axis=-1, dtype=jnp.int32)
    useful = jnp.sum(lengths - k0)  # tokens sampled by this call
    rollout = Rollout(
        tokens=tokens,
        logps=logps,
        sampling_logps=slogps,
        completion_mask=mask,
        lengths=lengths,
        truncated=~ended_eos,
        prompt_lengths=prompt_lengths,
    )
    stats = EngineStats(
        decode_steps=steps,
        useful_tokens=useful,
        prefills=admitted,
        decoded_rows=decoded,
        slot_utilization=useful / jnp.maximum(decoded, 1).astype(jnp.float32),
        slots=n,
    )
    return rollout, stats, done


def _check_requests(who: str, prompts, prompt_mask, prompt_len: int, max_lengths) -> int:
    """One-line ValueErrors for request arrays of the wrong shape; returns R."""
    if prompts.ndim != 2 or prompts.shape != prompt_mask.shape:
        raise ValueError(
            f"{who}: prompts {prompts.shape} and prompt_mask {prompt_mask.shape} must both be "
            "[R, Lp]"
        )
    r, lp = prompts.shape
    if lp != prompt_len:
        raise ValueError(f"{who}: prompt width {lp} != prompt_len {prompt_len}")
    if r == 0:
        raise ValueError(f"{who}: no requests (R == 0)")
    if max_lengths is not None and jnp.shape(max_lengths) != (r,):
        raise ValueError(f"{who}: max_lengths must be [R={r}], got {jnp.shape(max_lengths)}")
    return r


def make_continuous_generate_fn(
    config: ModelConfig,
    sampling: SamplingConfig,
    *,
    slots: int,
    prompt_len: int,
    return_stats: bool = False,
) -> Callable[..., Rollout | tuple[Rollout, EngineStats]]:
    """The pure (un-jitted) continuous-batching generation function.

    Returns f(params, prompts [R, Lp], prompt_mask [R, Lp], key, max_lengths=None) ->
    Rollout (R rows, in request order), or (Rollout, EngineStats) with return_stats.

    min(slots, R) decode slots serve the R requests (prompt rows) first come, first
    served. One loop iteration samples one token for every busy slot, feeds it through
    the model (one batched trunk call, a cache index and RoPE position per slot), and
    then refills the slots whose completions ended (EOS, or their budget) with the next
    queued requests: batched prefills of their prompts written into those slots' cache
    rows, and their attention masks replaced by the new prompts'. Once the queue is
    empty, the live slots are compacted into a batch of half the width whenever they fit
    (`batch_widths`); with S >= R every row moves in lock step and the cache width grows
    in `sampling.kv_buckets` phases, as in the static sampler. A row's cache layout is the
    static sampler's ([0, Lp) prompt, Lp + t completion token t), so a request sees the
    same computation wherever and whenever it runs. No host round trip per token.

    Token t of request i is drawn with key fold_in(fold_in(key, i), t) (`request_key`),
    so for one key the rollouts do not depend on `slots`. The static sampler derives its
    keys per step for the whole batch, so sampled rollouts differ from its; greedy
    (temperature 0) rollouts are the same. Log-probs follow `Rollout`'s contract.

    Args:
      config: static model config.
      sampling: `SamplingConfig`; `cache_size` and `row_groups` do not apply (each slot
        has Lp + max_new_tokens cache slots); `kv_buckets` phases the cache width when
        every request has a slot (S >= R), as in the static sampler.
      slots: S >= 1, rows decoded at once (the KV cache holds S rows).
      prompt_len: Lp, the prompts' (left-padded) width.
      return_stats: also return `EngineStats`.
    The returned function's `max_lengths` [R] int (optional) caps request i at
    min(max_lengths[i], max_new_tokens) tokens (at least 1); a row that reaches its cap
    without EOS is `truncated`, as one that reaches max_new_tokens.
    Raises:
      ValueError: slots < 1, a prompt width other than prompt_len, or bad sampling ids.
    """
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"continuous generate: slots must be an int >= 1, got {slots!r}")
    sampling.check(config)

    def generate_fn(params, prompts, prompt_mask, key, max_lengths=None):
        r = _check_requests("continuous generate", prompts, prompt_mask, prompt_len, max_lengths)
        rollout, stats, _ = _continuous_generate(
            params,
            prompts,
            prompt_mask,
            key,
            max_lengths,
            config=config,
            slots=min(slots, r),
            max_new_tokens=sampling.max_new_tokens,
            temperature=float(sampling.temperature),
            top_k=int(sampling.top_k),
            top_p=float(sampling.top_p),
            eos_ids=sampling.eos_ids,
            pad_id=int(sampling.pad_id),
            kv_buckets=int(sampling.kv_buckets),
        )
        return (rollout, stats) if return_stats else rollout

    return generate_fn


def make_partial_generate_fn(
    config: ModelConfig,
    sampling: SamplingConfig,
    *,
    slots: int,
    prompt_len: int,
    group_size: int,
    stop_groups: int,
) -> Callable[..., tuple[Rollout, jax.Array, EngineStats]]:
    """Continuous batching that stops early and resumes: the sampler of partial rollouts.

    "APRIL: Active Partial Rollouts in Reinforcement Learning to Tame Long-tail Generation"
    (Zhou et al., 2025): more groups are requested than a step trains on; once
    `stop_groups` groups of `group_size` consecutive requests are complete, generation
    stops, and the unfinished rows are continued by a later call (under newer parameters)
    from the tokens they have.

    Returns f(params, prompts [R, Lp], prompt_mask [R, Lp], key, prefix: Prefix,
    max_lengths=None) -> (Rollout, done bool[R], EngineStats). R must be a multiple of
    `group_size`; `max_lengths` [R] caps each request's total completion length (prefix
    included), as in `make_continuous_generate_fn`.

    - Requests are served in index order, those with a prefix first (put the oldest
      carried rows first), skipping those with `prefix.done`; a request with
      `prefix.lengths[i] = k` is prefilled with its prompt and its k tokens and samples
      from token k on, with keys `request_key(key, i, t)` as in
      `make_continuous_generate_fn`.
    - The loop ends when every request is done or at least `stop_groups` groups are
      (several may complete in the same decode step); a row still being decoded then has
      the tokens it sampled so far in the Rollout (`lengths`, mask, log-probs), and
      `done[i]` False. `truncated` is meaningful for done rows only.
    - The Rollout's first k tokens and log-probs of each request are the prefix's, as
      given: each token keeps the log-prob of the policy that sampled it.
    - `stop_groups = 0` serves every request (the result then equals
      `make_continuous_generate_fn`'s for an empty prefix, up to the prefill's rounding).
    - `EngineStats.useful_tokens` counts the tokens sampled by this call.

    Requests with a prefix are served first (in index order), then the fresh ones. A
    resumed request's prefill takes Lp + T positions (prompt and prefix), as APRIL's
    re-prefill of partial samples on the inference engine does; a fresh one takes Lp.
    """
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"partial generate: slots must be an int >= 1, got {slots!r}")
    if group_size < 1 or stop_groups < 0:
        raise ValueError(
            f"partial generate: group_size >= 1 and stop_groups >= 0 expected, got "
            f"{group_size} and {stop_groups}"
        )
    sampling.check(config)

    def generate_fn(params, prompts, prompt_mask, key, prefix: Prefix, max_lengths=None):
        r = _check_requests("partial generate", prompts, prompt_mask, prompt_len, max_lengths)
        if r % group_size:
            raise ValueError(
                f"partial generate: {r} requests are not a positive multiple of group_size "
                f"{group_size}"
            )
        t = sampling.max_new_tokens
        if prefix.tokens.shape != (r, t) or prefix.lengths.shape != (r,):
            raise ValueError(
                f"partial generate: prefix tokens {prefix.tokens.shape} / lengths "
                f"{prefix.lengths.shape}, expected [{r}, {t}] / [{r}]"
            )
        rollout, stats, done = _continuous_generate(
            params,
            prompts,
            prompt_mask,
            key,
            max_lengths,
            prefix,
            config=config,
            slots=min(slots, r),
            max_new_tokens=t,
            temperature=float(sampling.temperature),
            top_k=int(sampling.top_k),
            top_p=float(sampling.top_p),
            eos_ids=sampling.eos_ids,
            pad_id=int(sampling.pad_id),
            group_size=group_size,
            stop_groups=stop_groups,
        )
        return rollout, done, stats

    return generate_fn
