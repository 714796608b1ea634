"""Rollout throughput of the static sampler vs the continuous-batching engine when
completion lengths vary: useful (non-padding) tokens/s, slot utilization, wall time.

    python -m benchmarks.rollout            # defaults: about a minute on 2 CPU cores

prints one JSON line per (length case, engine, slot count). Cases: "heavy_tail", lengths drawn from
a log-normal (deterministic quantiles, shuffled) whose sigma is solved so that
max/mean = --max-over-mean (8), and "equal", every row --mean-len tokens.

How the lengths are enforced (no EOS ids, so the random model cannot end a row early):
  * continuous: `max_lengths` = the drawn lengths; a slot is refilled when its row
    reaches its length.
  * static: what a forced EOS at each row's drawn length would give the static
    sampler, whose loop runs until the batch's longest row ends: each batch is
    generated with max_new_tokens = its longest drawn length (one compile per distinct
    value, outside the timing); tokens past a row's own length are padding.
    "static" decodes all N rows as one batch (the trainer's way); "static_chunked"
    decodes N / S batches of S rows one after another, the same KV-cache footprint as
    the engine's S slots.
useful_tokens = sum of drawn lengths, the same for every engine; tokens_per_s =
useful_tokens / median wall time, the engines called in turn, repeat after repeat (load
drift hits all alike; speedup_vs_static is the ratio of medians); slot_utilization =
useful_tokens / rows decoded over all steps.
The continuous engine serves requests first come, first served, not knowing their
lengths, so its steps are at least (admission step + length) of the longest request:
with a heavy tail and few requests per slot, that tail bounds its utilization.

A third case, "rl_steps", times --rl-steps RL steps of P x G = --rollouts rollouts
(groups of --group-size, fresh heavy-tailed lengths for every prompt):
  * "continuous": every step serves its P x G requests to the end;
  * "partial" (APRIL, `jaxrl_llm.partial`): every step requests --extra-groups more
    groups, stops once P groups are complete, and carries the rest (resumed first, from
    their tokens, by the next step), as the trainer does with rl.partial_rollouts.
Its lines report the median wall time per step (after a compile step; both modes' steps
interleaved), the mean decode steps and decoded rows per step, and, for "partial",
the staleness of the trained tokens (steps since each was sampled: mean, max, and the
fraction sampled in an earlier step). Parameters do not change between steps here: the
line measures the rollout system, not learning.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import (
    add_model_args,
    emit,
    model_from_args,
    time_interleaved,
)
from jaxrl_llm import partial
from jaxrl_llm.data import PromptBatch
from jaxrl_llm.engine import make_continuous_generate_fn, make_partial_generate_fn
from jaxrl_llm.models import init_params
from jaxrl_llm.sampler import SamplingConfig, make_generate_fn


def heavy_tail_lengths(n: int, mean: float, max_over_mean: float, seed: int = 0) -> np.ndarray:
    """n lengths >= 1: log-normal quantiles exp(sigma z_i), z_i = Phi^-1((i + 1/2) / n),
    with sigma solved (bisection) so that max/mean = max_over_mean, scaled to `mean`,
    rounded and shuffled. Returns [n] int32."""
    z = np.array([statistics.NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])

    def ratio(sigma):
        x = np.exp(sigma * z)
        return x.max() / x.mean()

    lo, hi = 0.0, 5.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) < max_over_mean else (lo, mid)
    x = np.exp(lo * z)
    lengths = np.maximum(1, np.round(x / x.mean() * mean)).astype(np.int32)
    return np.random.default_rng(seed).permutation(lengths)


def run_case(args, config, params, name: str, lengths: np.ndarray) -> list[dict]:
    n, s, lp = args.rollouts, args.slots, args.prompt_len
    t_max = int(lengths.max())
    kp, key = jax.random.split(jax.random.key(1))
    prompts = jax.random.randint(kp, (n, lp), 1, config.vocab_size)
    mask = jnp.ones((n, lp), bool)
    useful = int(lengths.sum())
    base = {"benchmark": "rollout", "case": name, "rollouts": n, "useful_tokens": useful}
    base |= {"mean_len": float(lengths.mean()), "max_len": t_max, "prompt_len": lp}
    calls, records = {}, {}  # engine label -> callable, and its line (timing added below)

    def static(batch: int, label: str) -> None:
        chunks = [slice(i, i + batch) for i in range(0, n, batch)]
        fns = {}
        t0 = time.perf_counter()
        for c in chunks:
            t = int(lengths[c].max())
            if t not in fns:
                sampling = SamplingConfig(max_new_tokens=t, temperature=args.temperature)
                fn = jax.jit(make_generate_fn(config, sampling))
                fns[t] = fn.lower(params, prompts[c], mask[c], key).compile()
        compile_s = time.perf_counter() - t0
        calls[label] = lambda: [
            fns[int(lengths[c].max())](params, prompts[c], mask[c], key) for c in chunks
        ]
        steps = sum(int(lengths[c].max()) for c in chunks)
        records[label] = {
            **base,
            "engine": label.split("/")[0],
            "slots": batch,
            "slot_utilization": useful / (batch * steps),
            "decode_steps": steps,
            "compile_s": compile_s,
        }

    static(n, "static")
    static(s, "static_chunked")

    sampling = SamplingConfig(max_new_tokens=t_max, temperature=args.temperature)
    budgets = jnp.asarray(lengths)
    for slots in args.slot_counts:
        fn = make_continuous_generate_fn(
            config, sampling, slots=slots, prompt_len=lp, return_stats=True
        )
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(params, prompts, mask, key, budgets).compile()
        compile_s = time.perf_counter() - t0
        rollout, stats = compiled(params, prompts, mask, key, budgets)
        if not np.array_equal(np.asarray(rollout.lengths), lengths):
            raise AssertionError("continuous engine: lengths differ from the drawn ones")
        label = f"continuous/{slots}"
        calls[label] = lambda c=compiled: c(params, prompts, mask, key, budgets)
        records[label] = {
            **base,
            "engine": "continuous",
            "slots": slots,
            "slot_utilization": float(stats.slot_utilization),
            "decode_steps": int(stats.decode_steps),
            "compile_s": compile_s,
        }
    # Every engine is called in turn, repeat after repeat: their ratios are side by side.
    timed = time_interleaved(calls, repeats=args.repeats)
    static_s = timed["static"]["median_s"]
    for label, record in records.items():
        wall = timed[label]["median_s"]
        record |= {
            "tokens_per_s": useful / wall,
            "wall_s": wall,
            "speedup_vs_static": static_s / wall,
        }
    return list(records.values())


def rl_steps_case(args, config, params) -> list[dict]:
    """Time per RL step with and without partial rollouts (see the module docstring)."""
    n, g, lp = args.rollouts, args.group_size, args.prompt_len
    p = n // g
    pool_lengths = heavy_tail_lengths(4096, args.mean_len, args.max_over_mean, seed=2)
    t_max = int(pool_lengths.max())
    sampling = SamplingConfig(max_new_tokens=t_max, temperature=args.temperature)

    def fresh(groups: int, rng: np.random.Generator) -> partial.Pool:
        tokens = rng.integers(1, config.vocab_size, (groups, lp)).astype(np.int32)
        lengths = rng.choice(pool_lengths, (groups, g))  # this prompt's rows' EOS schedule
        batch = PromptBatch(
            tokens=tokens,
            mask=np.ones((groups, lp), bool),
            lengths=np.full((groups,), lp, np.int32),
            prompts=("",) * groups,
            answers=("",) * groups,
            metadata=tuple({"lengths": row.tolist()} for row in lengths),
        )
        return partial.Pool.fresh(batch, g, t_max, pad_id=0)

    runs = []  # one per (slot count, mode); their steps are interleaved below
    for slots in args.rl_slot_counts:
        for mode in ("continuous", "partial"):
            extra = args.extra_groups if mode == "partial" else 0
            fn = make_partial_generate_fn(
                config,
                sampling,
                slots=slots or (p + extra) * g,  # 0: every request has a slot
                prompt_len=lp,
                group_size=g,
                stop_groups=p if mode == "partial" else 0,
            )
            runs.append(dict(mode=mode, slots=slots, extra=extra, fn=jax.jit(fn), pool=None))
            # Every run draws the same fresh prompts and lengths, in the same order.
            runs[-1] |= dict(rng=np.random.default_rng(1), times=[], lags=[], stale=[])
            runs[-1] |= dict(maxlag=0, tokens=0, steps=[], rows=[])
    for step in range(args.rl_steps + 1):  # step 0 compiles
        for run in runs:
            pool, extra = run["pool"], run["extra"]
            need = p + extra - (pool.num_groups if pool else 0)
            if need > 0:
                new = fresh(need, run["rng"])
                pool = new if pool is None else pool.concat(new)
            work = pool.take(np.arange(p + extra))
            rest = pool.take(np.arange(p + extra, pool.num_groups))
            budgets = jnp.asarray([x for m in work.metadata for x in m["lengths"]], jnp.int32)
            key = jax.random.fold_in(jax.random.key(3), step)
            t0 = time.perf_counter()
            rollout, done, stats = run["fn"](
                params,
                jnp.asarray(work.prompts),
                jnp.asarray(work.prompt_mask),
                key,
                partial.prefix_of(work, jnp.asarray),
                budgets,
            )
            jax.block_until_ready(rollout)
            elapsed = time.perf_counter() - t0
            trained, waiting = partial.settle(work, rollout, done, step, p)
            run["pool"] = waiting.concat(rest)
            if step == 0:
                continue
            run["times"].append(elapsed)
            mask = np.arange(t_max)[None] < trained.lengths[:, None]
            lag = np.where(mask, step - trained.versions, 0)
            run["lags"].append(lag.sum() / mask.sum())
            run["maxlag"] = max(run["maxlag"], int(lag.max()))
            run["stale"].append(((lag > 0) & mask).sum() / mask.sum())
            run["tokens"] += int(mask.sum())
            run["steps"].append(int(stats.decode_steps))
            run["rows"].append(int(stats.decoded_rows))
    records = []
    for run in runs:
        base = next(r for r in runs if r["slots"] == run["slots"] and r["mode"] == "continuous")
        step_s = float(np.median(run["times"]))
        records.append(
            {
                "benchmark": "rollout",
                "case": "rl_steps",
                "engine": run["mode"],
                "rollouts_per_step": n,
                "group_size": g,
                "extra_groups": run["extra"],
                "slots": run["slots"],
                "rl_steps": args.rl_steps,
                "step_s": step_s,
                "speedup_vs_continuous": float(np.median(base["times"])) / step_s,
                "trained_tokens_per_s": run["tokens"] / float(np.sum(run["times"])),
                # Per RL step: loop iterations (what a step costs where a decode step's
                # cost hardly depends on the batch, as on a GPU) and rows decoded (what it
                # costs where it grows with the batch, as on this CPU).
                "decode_steps": float(np.mean(run["steps"])),
                "decoded_rows": float(np.mean(run["rows"])),
                "staleness_mean": float(np.mean(run["lags"])),
                "staleness_max": run["maxlag"],
                "stale_token_frac": float(np.mean(run["stale"])),
                "mean_len": float(pool_lengths.mean()),
                "max_len": t_max,
            }
        )
    return records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.set_defaults(d_model=64, ffn=256, layers=2)
    p.add_argument("--rollouts", type=int, default=256, help="N requests")
    p.add_argument(
        "--slots",
        default="32,0",
        help="S decode slots of the continuous engine, comma-separated, one line each (0 = "
        "--rollouts: every request has a slot); the first also sizes static_chunked. rl_steps "
        "runs one continuous and one partial line per count (0: every request of a step)",
    )
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--mean-len", type=int, default=16)
    p.add_argument("--max-over-mean", type=float, default=8.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--group-size", type=int, default=8, help="G (rl_steps case)")
    p.add_argument("--extra-groups", type=int, default=8, help="APRIL over-provisioning")
    p.add_argument("--rl-steps", type=int, default=4, help="timed RL steps (rl_steps case)")
    p.add_argument("--cases", default="heavy_tail,equal,rl_steps")
    args = p.parse_args(argv)
    args.rl_slot_counts = [int(x) for x in args.slots.split(",")]
    args.slot_counts = [x or args.rollouts for x in args.rl_slot_counts]
    args.slots = args.slot_counts[0]
    if args.rollouts % args.slots:
        raise ValueError(f"--slots {args.slots} must divide --rollouts {args.rollouts}")
    config = model_from_args(args, dtype="float32", param_dtype="float32")
    params = init_params(config, jax.random.key(0))
    cases = {
        "heavy_tail": heavy_tail_lengths(args.rollouts, args.mean_len, args.max_over_mean),
        "equal": np.full((args.rollouts,), args.mean_len, np.int32),
    }
    wanted = args.cases.split(",")
    for name, lengths in cases.items():
        if name in wanted:
            for record in run_case(args, config, params, name, lengths):
                emit(record)
    if "rl_steps" in wanted and args.rl_steps > 0:
        for record in rl_steps_case(args, config, params):
            emit(record)


if __name__ == "__main__":
    main()
