"""Sampler throughput: generated tokens/s, compile time and MFU of `jaxrl_llm.sampler`.

    python -m benchmarks.sampler --d-model 256 --layers 4 --heads 4 --kv-heads 2 \
        --ffn 1024 --vocab 64 --batch 256 --prompt-len 8 --new-tokens 64

prints one JSON line (one per batch size with --batch-sweep 32,64,128,256). No EOS ids
are passed, so every row generates exactly --new-tokens tokens and
tokens_per_s = batch * new_tokens / median wall time of the compiled program.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from benchmarks._common import (
    add_device_args,
    add_model_args,
    add_sampler_args,
    emit,
    matmul_ceiling,
    model_from_args,
    time_call,
    use_host_devices,
)
from jaxrl_llm import sharding
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.sampler import SamplingConfig, default_row_groups, make_generate_fn


def model_flops(config: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Useful model FLOPs of prefill + decode (2 per multiply-add).

    Per token: 2 x (matmul params of all blocks + unembedding D x V), plus attention
    scores and values, 4 x N x H x (number of keys it attends to, causal).
    Decode feeds T - 1 tokens (the last sampled token needs no forward pass).
    """
    c = config
    d, h = c.d_model, c.head_dim
    block = d * h * (c.n_heads + 2 * c.n_kv_heads) + c.n_heads * h * d + 3 * d * c.ffn_dim
    dense = 2 * (c.n_layers * block + d * c.vocab_size)
    attn_per_key = 4 * c.n_layers * c.n_heads * h
    prefill_keys = prompt_len * (prompt_len + 1) / 2
    decode_keys = sum(prompt_len + i + 1 for i in range(new_tokens - 1))
    tokens = prompt_len + new_tokens - 1
    return batch * (dense * tokens + attn_per_key * (prefill_keys + decode_keys))


def run(args: argparse.Namespace, config: ModelConfig, batch: int, ceiling: float) -> dict:
    params = init_params(config, jax.random.key(0))
    kp, ks = jax.random.split(jax.random.key(1))
    prompts = jax.random.randint(kp, (batch, args.prompt_len), 0, config.vocab_size)
    mask = jnp.ones((batch, args.prompt_len), bool)
    fn = make_generate_fn(
        config,
        SamplingConfig(
            max_new_tokens=args.new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            kv_buckets=args.kv_buckets,
            row_groups=args.row_groups or None,
        ),
    )
    mesh = sharding.make_mesh(data=jax.device_count())  # data parallel over the host devices
    batch_sharding, replicated = sharding.batch_sharding(mesh), sharding.replicated(mesh)
    if batch % jax.device_count():
        raise ValueError(f"--batch {batch} is not divisible by {jax.device_count()} devices")
    params = jax.device_put(params, replicated)
    prompts, mask = jax.device_put((prompts, mask), batch_sharding)
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(params, prompts, mask, ks).compile()
    compile_s = time.perf_counter() - t0
    stats = time_call(lambda: compiled(params, prompts, mask, ks), repeats=args.repeats)
    generated = batch * args.new_tokens
    flops = model_flops(config, batch, args.prompt_len, args.new_tokens)
    return {
        "benchmark": "sampler",
        "tokens_per_s": generated / stats["median_s"],
        "median_s": stats["median_s"],
        "min_s": stats["min_s"],
        "compile_s": compile_s,
        "params": sum(x.size for x in jax.tree.leaves(params)),
        "mfu": flops / stats["median_s"] / ceiling,
        "model_gflops_per_s": flops / stats["median_s"] / 1e9,
        "ceiling_gflops_per_s": ceiling / 1e9,
        "batch": batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "kv_buckets": args.kv_buckets,
        "row_groups": args.row_groups or default_row_groups(batch // jax.device_count()),
        "dtype": config.dtype,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batch-sweep", type=str, default="", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    add_sampler_args(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=7)
    add_device_args(p)
    args = p.parse_args(argv)
    use_host_devices(args.host_devices)  # before the first JAX computation

    config = model_from_args(args, dtype=args.dtype, param_dtype=args.dtype)
    ceiling = matmul_ceiling(config.jnp_dtype)
    batches = [int(b) for b in args.batch_sweep.split(",") if b] or [args.batch]
    for batch in batches:
        emit(run(args, config, batch, ceiling))


if __name__ == "__main__":
    main()
