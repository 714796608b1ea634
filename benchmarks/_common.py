"""Shared benchmark helpers: median wall-clock timing and a measured matmul ceiling for MFU.

MFU here = model FLOPs per second / the FLOP rate of a large square matmul measured in
the same process, so it is relative to what XLA achieves on this machine, not to a
datasheet peak (CPUs rarely publish a usable one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.models import ModelConfig


def block(tree: Any) -> Any:
    """Waits for every array in `tree` (JAX dispatch is asynchronous)."""
    return jax.block_until_ready(tree)


def time_interleaved(
    fns: dict[str, Callable[[], Any]], *, repeats: int = 5, warmup: int = 1
) -> dict[str, dict[str, float]]:
    """`time_call` for several functions at once, called in turn (round robin) so that
    load drift on a shared machine hits them alike; the ratios of their medians are the
    side-by-side comparison. Returns {name: {"median_s", "min_s", "max_s"}}."""
    for _ in range(warmup):
        for fn in fns.values():
            block(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            block(fn())
            times[name].append(time.perf_counter() - t0)
    return {
        name: {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}
        for name, ts in times.items()
    }


def time_call(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Wall-clock seconds of `fn()` (blocked on its outputs).

    Runs `warmup` untimed calls (compilation, caches), then `repeats` timed ones.
    Returns {"median_s", "min_s", "max_s", "first_s"} where first_s is the first warmup
    call (compile + run when fn is freshly jitted; NaN without warmup).
    """
    first = float("nan")
    for w in range(warmup):
        t0 = time.perf_counter()
        block(fn())
        if w == 0:
            first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - t0)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "first_s": first,
    }


def matmul_ceiling(dtype: Any = jnp.float32, n: int = 2048, repeats: int = 7) -> float:
    """Achieved FLOP/s of an n x n x n matmul in `dtype` (median of `repeats` runs).

    2 n^3 FLOPs per call; the operands live on the default device.
    """
    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    stats = time_call(lambda: f(a, b), repeats=repeats, warmup=2)
    return 2.0 * n**3 / stats["median_s"]


def emit(record: dict[str, Any]) -> None:
    """Prints `record` as one JSON line (floats rounded to 4 significant digits)."""

    def fmt(v: Any) -> Any:
        if isinstance(v, float):
            return float(f"{v:.4g}")
        return v

    print(json.dumps({k: fmt(v) for k, v in record.items()}), flush=True)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model-shape flags shared by every benchmark (defaults: the issues' shape)."""
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None, help="default d_model / heads")
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=64)


def model_from_args(args: argparse.Namespace, *, dtype: str, param_dtype: str) -> ModelConfig:
    """The ModelConfig described by `add_model_args` flags."""
    return ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.head_dim or args.d_model // args.heads,
        ffn_dim=args.ffn,
        tie_embeddings=True,
        param_dtype=param_dtype,
        dtype=dtype,
    )


def add_sampler_args(p: argparse.ArgumentParser) -> None:
    """The sampler layout flags shared by the benchmarks that sample."""
    p.add_argument("--kv-buckets", type=int, default=4)
    p.add_argument("--row-groups", type=int, default=0, help="sampler row groups (0 = the default)")


def add_device_args(p: argparse.ArgumentParser) -> None:
    """--host-devices: how many JAX devices the host CPU is split into."""
    p.add_argument(
        "--host-devices",
        type=int,
        default=0,
        help="CPU: expose the host as N JAX devices (XLA's host platform device count) and "
        "shard the batch over them; 0 = one per core available to this process",
    )


def use_host_devices(n: int) -> int:
    """Sets XLA's host device count to `n` (0 = the usable cores) before JAX starts a
    backend; returns n. The devices share the host's cores, each running its part of a
    batch-sharded program: a data-parallel mesh on one machine, the same code path as a
    multi-device accelerator or a multi-host slice."""
    n = n or len(os.sched_getaffinity(0))
    flag = f"--xla_force_host_platform_device_count={n}"
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    return n
