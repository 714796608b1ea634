"""A floor under `benchmarks.grpo_step`: the step's dense matmuls alone, each at its best rate.

    python -m benchmarks.step_floor --d-model 256 --layers 4 --heads 4 --kv-heads 2 \
        --ffn 1024 --vocab 64 --prompts 8 --group 8 --prompt-len 8 --new-tokens 32

prints one JSON line. Every weight matmul a GRPO step must run is listed with its shape
and count (the sampler's fused projections, as `sampler.py` runs them):

- sample: prefill of N x Lp rows, then T - 1 decode steps of N rows, per layer
  x @ [qkv | o | gate_up | down], then the unembedding of the N last positions;
- update: forward of N x (Lp + T) rows (the same four per layer, unfused as the train
  step runs them: q, k, v, o, gate, up, down, plus the unembedding), and the backward's
  two matmuls per forward matmul, dx = dy W^T and dW = x^T dy.

Each distinct shape is timed alone, many times back to back inside one compiled
`lax.fori_loop` (no dispatch in the timing), with both cores; `floor_s` = sum over the
list of count x best time, the update counted both unfused (as the train step runs it)
and fused like the sampler, whichever is faster. Attention, norms, activations,
sampling and the optimizer are left out, so the real step can only be slower: the floor
says which step-time targets this machine's matmul kernels allow at all.
"""

from __future__ import annotations

import argparse
import collections
import time

import jax
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from benchmarks._common import (
    add_device_args,
    add_model_args,
    emit,
    model_from_args,
    use_host_devices,
)
from jaxrl_llm.models import ModelConfig

# (m, k, n, transposed_lhs): x [m, k] @ w [k, n]; transposed_lhs: x^T dy with x [k, m].
Shape = tuple[int, int, int, bool]


def step_matmuls(
    c: ModelConfig, n: int, lp: int, t: int, fused_update: bool = False
) -> collections.Counter:
    """{shape: count} of the weight matmuls of one step (see the module docstring).

    fused_update: the update's projections as the sampler fuses them (q|k|v and
    gate|up as one matmul each: same FLOPs, fewer and wider matmuls).
    """
    d, h, f, v = c.d_model, c.head_dim, c.ffn_dim, c.vocab_size
    q, kv = c.n_heads * h, c.n_kv_heads * h
    mm: collections.Counter = collections.Counter()

    def fused_block(rows: int, times: int) -> None:
        for k_, n_ in ((d, q + 2 * kv), (q, d), (d, 2 * f), (f, d)):
            mm[(rows, k_, n_, False)] += times * c.n_layers

    fused_block(n * lp, 1)  # prefill
    fused_block(n, t - 1)  # decode
    mm[(n, d, v, False)] += t  # unembedding of the last position, prefill + decode

    rows = n * (lp + t)
    weights = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    if fused_update:
        weights = [(d, q + 2 * kv), (q, d), (d, 2 * f), (f, d)]
    for k_, n_ in weights:
        mm[(rows, k_, n_, False)] += c.n_layers  # forward
        mm[(rows, n_, k_, False)] += c.n_layers  # dx = dy W^T
        mm[(k_, rows, n_, True)] += c.n_layers  # dW = x^T dy
    mm[(rows, d, v, False)] += 1
    mm[(rows, v, d, False)] += 1
    mm[(d, rows, v, True)] += 1
    return mm


def best_time(shape: Shape, iters: int, repeats: int = 5) -> float:
    """Best seconds per matmul of `shape`, over `repeats` runs of an `iters`-long loop.

    With several devices the rows are split over them (data parallel: x and, for
    dW = x^T dy, dy sharded by row; w replicated) and every device runs its share in a
    local loop (`shard_map`, no communication): the time is that of all shares at once.
    """
    m, k, n, transposed = shape
    key_x, key_w = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (k, m) if transposed else (m, k))
    w = jax.random.normal(key_w, (k, n))
    dims = (((0,), (0,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))

    def local_loop(x, w):
        def body(_, carry):
            # Each product feeds one element of the next one's input (in place; x + 0 * y
            # is not simplified for floats), so XLA can neither hoist the matmul out of
            # the loop nor drop iterations.
            x, acc = carry
            y = lax.dot_general(x.at[0, 0].add(acc * 0.0), w, dims)
            return x, y[0, 0]

        acc = lax.fori_loop(0, iters, body, (x, x[0, 0] * 0.0))[1]
        return acc[None]

    mesh = Mesh(jax.devices(), ("data",))
    rows = PartitionSpec("data")
    loop = jax.jit(
        jax.shard_map(
            local_loop,
            mesh=mesh,
            in_specs=(rows, rows if transposed else PartitionSpec()),
            out_specs=rows,
        )
    )
    loop(x, w).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loop(x, w).block_until_ready()
        times.append((time.perf_counter() - t0) / iters)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--target-s", type=float, default=0.35, help="step-time target to compare")
    add_device_args(p)
    args = p.parse_args(argv)
    use_host_devices(args.host_devices)  # before the first JAX computation
    config = model_from_args(args, dtype="float32", param_dtype="float32")
    n = args.prompts * args.group
    rows_update = n * (args.prompt_len + args.new_tokens)
    seconds: dict[Shape, float] = {}
    stages = collections.Counter()  # seconds per stage
    flops = collections.Counter()
    for fused in (False, True):
        mm = step_matmuls(config, n, args.prompt_len, args.new_tokens, fused_update=fused)
        for shape, count in mm.items():
            m, k, n_, _ = shape
            stage = "update" if rows_update in (m, k) else "sample"
            if stage == "sample" and fused:
                continue  # the sample stage is the same list both times
            stage += "_fused" if fused else ""
            if shape not in seconds:
                seconds[shape] = best_time(
                    shape, iters=min(2000, max(5, int(2e9 / (2 * m * k * n_))))
                )
            stages[stage] += count * seconds[shape]
            flops[stage] += count * 2.0 * m * k * n_
    update = min(stages["update"], stages["update_fused"])
    floor = stages["sample"] + update
    emit(
        {
            "benchmark": "step_floor",
            "floor_s": floor,
            "sample_floor_s": stages["sample"],
            "update_floor_s": stages["update"],
            "update_fused_floor_s": stages["update_fused"],
            "matmul_gflops": (flops["sample"] + flops["update"]) / 1e9,
            "sample_gflops_per_s": flops["sample"] / stages["sample"] / 1e9,
            "update_gflops_per_s": flops["update"] / stages["update"] / 1e9,
            "target_s": args.target_s,
            "target_over_floor": args.target_s / floor,
            "devices": jax.device_count(),
        }
    )


if __name__ == "__main__":
    main()
