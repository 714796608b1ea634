"""One GRPO step end to end: sample -> score -> advantages -> update, with a stage breakdown.

    python -m benchmarks.grpo_step --d-model 256 --layers 4 --heads 4 --kv-heads 2 \
        --ffn 1024 --vocab 64 --prompts 8 --group 8 --prompt-len 8 --new-tokens 32

prints one JSON line. A random-init policy of the given shape samples G completions for
each of P random prompts (N = P * G rows, temperature 1, exactly T tokens: no EOS ids);
each stage is the trainer's own compiled program (`jaxrl_llm.stages.build_stages`, the
same jit with shardings that `python -m jaxrl_llm.train` runs), run and blocked on in order:

- sample: the stage sampler (prefill + KV-cache decode).
- score: a synthetic verifiable reward on device, reward = fraction of even token ids in
  the completion (in [0, 1]; varies within a group, so GRPO advantages are non-zero).
- advantages: `stages.rollouts_to_batch` + the chain stage with `chain(group_advantages(
  "grpo"))` (old log-probs from the sampler: the step needs no extra forward pass).
- update: the update stage (`make_train_step`, AdamW via `make_optimizer`, the state
  donated), one epoch, one mini-batch of --micro-batch row micro-batches.

step_s is the median wall time of the whole step (compilation excluded: first_step_s is
the first step, which compiles every stage); the stage times are medians of the same
steps. tokens_per_s counts generated tokens (N * T) per step_s. mfu = model FLOPs per
step / step_s / the matmul ceiling measured in the same process (`_common`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import (
    add_device_args,
    add_model_args,
    add_sampler_args,
    block,
    emit,
    matmul_ceiling,
    model_from_args,
    use_host_devices,
)
from benchmarks.sampler import model_flops as sample_flops
from jaxrl_llm import sharding, stages
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampler import SamplingConfig
from jaxrl_llm.train_step import LossConfig, make_optimizer
from jaxrl_llm.transforms import chain, group_advantages
from jaxrl_llm.types import Rollouts


def step_flops(config: ModelConfig, n: int, prompt_len: int, new_tokens: int) -> dict:
    """Model FLOPs of one step (2 per multiply-add), attention included.

    sample = `benchmarks.sampler.model_flops(config, N, Lp, T)`: prefill of Lp tokens and
      T - 1 decode tokens, each 2 x (block matmul params + D x V) plus causal attention
      4 x layers x heads x head_dim per (query, key) pair.
    update = 3 x forward over N x (Lp + T) tokens (forward + backward = 2 x forward); the
      forward is the same formula with L = Lp + T prompt tokens and no decode
      (`model_flops(config, N, L, 1)`: dense x L + attention x L (L + 1) / 2 per row).
    Score and advantages are O(N T) and not counted.
    """
    sample = sample_flops(config, n, prompt_len, new_tokens)
    update = 3.0 * sample_flops(config, n, prompt_len + new_tokens, 1)
    return {"sample": sample, "update": update, "total": sample + update}


def even_fraction_reward(tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """float32[N]: fraction of the completion's tokens with an even id (0 if empty)."""
    m = mask.astype(jnp.float32)
    even = (tokens % 2 == 0).astype(jnp.float32)
    return jnp.sum(even * m, -1) / jnp.maximum(jnp.sum(m, -1), 1.0)


def build_programs(args: argparse.Namespace, config: ModelConfig, mesh=None):
    """(state, inputs, stages, transform chain) for the configured step.

    The stages are the trainer's own (`jaxrl_llm.stages.build_stages`): the same jitted
    sampler, batch building, transform chain and update, sharded over a data-parallel mesh
    of the host devices (rows split, the policy and optimizer state replicated; XLA inserts
    the gradient all-reduce), or over `mesh` when given (`benchmarks.scaling`).
    """
    p, g, lp = args.prompts, args.group, args.prompt_len
    n = p * g
    mesh = mesh or sharding.make_mesh(data=jax.device_count())
    sizes = dict(mesh.shape)
    sharding.validate_mesh(
        sizes,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        rows=n,
        num_devices=jax.device_count(),
    )
    if n % (sizes["data"] * sizes["fsdp"] * g):
        raise ValueError(f"{n} rollouts do not split into whole groups over data x fsdp")
    sampling = SamplingConfig(
        max_new_tokens=args.new_tokens,
        temperature=1.0,
        kv_buckets=args.kv_buckets,
        row_groups=args.row_groups or None,
    )
    estimator = chain(group_advantages("grpo"))
    loss_cfg = LossConfig(aggregation=args.aggregation, micro_batch_size=args.micro_batch)
    optimizer = make_optimizer(
        learning_rate=1e-5, total_steps=1000, warmup_steps=10, weight_decay=0.01
    )
    st = stages.build_stages(
        model=config,
        sampling=sampling,
        greedy=sampling.replace(temperature=0.0),
        eval_sampling=sampling,
        loss=loss_cfg,
        chain=estimator,
        optimizer=optimizer,
        group_size=g,
        mesh=mesh,
        rules=sharding.DEFAULT_RULES,
        seed=0,
    )
    example = Rollouts.create(jnp.zeros((p, g)), token_mask=jnp.ones((p, g, args.new_tokens), bool))
    state = st.init_state(st.init_params(), estimator.init(example))
    kp, key = jax.random.split(jax.random.key(1))
    prompts = np.repeat(np.asarray(jax.random.randint(kp, (p, lp), 0, config.vocab_size)), g, 0)
    inputs = (
        stages.to_global(prompts, st.rows),
        stages.to_global(np.ones((n, lp), bool), st.rows),
        key,
    )
    score = jax.jit(
        lambda rollout: even_fraction_reward(rollout.tokens, rollout.completion_mask)[:, None],
        out_shardings=st.rows,
    )
    return state, inputs, st, score


def run_step(state, inputs, st, score, i: int) -> tuple:
    """One GRPO step through the trainer's stages, blocking after each; returns
    (state, metrics, {stage: s})."""
    prompts, prompt_mask, key = inputs
    c0, t0 = os.times(), time.perf_counter()
    rollout = block(
        st.generate(
            state.params,
            prompts,
            prompt_mask,
            stages.key_data(jax.random.fold_in(key, i), st.replicated),
        )
    )
    t1 = time.perf_counter()
    rewards = block(score(rollout))  # [N, 1]
    t2 = time.perf_counter()
    scored = stages.Scored(
        batch=st.to_batch(prompts, prompt_mask, rollout),
        rewards=rewards,
        truncated=rollout.truncated,
    )
    batch, _, transform_state = block(st.chain(scored, state.transform_state, None))
    t3 = time.perf_counter()
    state, metrics = block(st.update(state.replace(transform_state=transform_state), batch, {}))
    t4, c4 = time.perf_counter(), os.times()
    times = {"sample_s": t1 - t0, "score_s": t2 - t1, "advantages_s": t3 - t2, "update_s": t4 - t3}
    times["step_s"] = t4 - t0
    # Process CPU seconds (all threads): a contention-robust companion of the wall time.
    times["step_cpu_s"] = c4.user + c4.system - c0.user - c0.system
    return state, metrics, times


def add_step_args(p: argparse.ArgumentParser, **defaults) -> None:
    """The flags of one GRPO step (model, batch, sampler, loss, timing), shared with
    `benchmarks.scaling`; `defaults` overrides their defaults."""
    add_model_args(p)
    p.add_argument("--prompts", type=int, default=8, help="P prompts per step")
    p.add_argument("--group", type=int, default=8, help="G completions per prompt")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    add_sampler_args(p)
    p.add_argument(
        "--aggregation", default="token-mean", choices=["token-mean", "seq-mean-token-mean"]
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="rows per gradient-accumulation micro-batch (0 = all N); does not change the gradient",
    )
    p.add_argument("--steps", type=int, default=7, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    p.set_defaults(**defaults)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_args(p)
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype"
    )
    add_device_args(p)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    use_host_devices(args.host_devices)  # before the first JAX computation

    # float32 master weights always (AdamW state and updates stay float32);
    # --dtype is the compute dtype of activations and matmuls.
    config = model_from_args(args, dtype=args.dtype, param_dtype="float32")
    state, inputs, st, score = build_programs(args, config)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    t0 = time.perf_counter()
    state, _, _ = run_step(state, inputs, st, score, 0)  # compiles every stage
    compile_s = time.perf_counter() - t0
    for i in range(args.warmup):
        state, _, _ = run_step(state, inputs, st, score, 1 + i)
    records, ceilings = [], []
    for i in range(args.steps):
        state, metrics, times = run_step(state, inputs, st, score, 1 + args.warmup + i)
        records.append(times)
        # Interleaved with the steps so a shared machine's load drift hits both alike.
        ceilings.append(matmul_ceiling(config.jnp_dtype, repeats=3))
    ceiling = statistics.median(ceilings)

    med = {k: statistics.median(r[k] for r in records) for k in records[0]}
    n = args.prompts * args.group
    flops = step_flops(config, n, args.prompt_len, args.new_tokens)
    emit(
        {
            "benchmark": "grpo_step",
            "step_s": med["step_s"],
            "stages": {
                k: round(med[k], 4) for k in ("sample_s", "score_s", "advantages_s", "update_s")
            },
            "first_step_s": compile_s,  # compilation of every stage + one step
            "params": n_params,
            "tokens_per_s": n * args.new_tokens / med["step_s"],
            "model_gflops": flops["total"] / 1e9,
            "mfu": flops["total"] / med["step_s"] / ceiling,
            "mfu_sample": flops["sample"] / med["sample_s"] / ceiling,
            "mfu_update": flops["update"] / med["update_s"] / ceiling,
            "ceiling_gflops_per_s": ceiling / 1e9,
            "step_min_s": min(r["step_s"] for r in records),
            "step_cpu_s": med["step_cpu_s"],
            "loss": float(metrics["loss"]),
            "rows": n,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "aggregation": args.aggregation,
            "micro_batch": args.micro_batch,
            "dtype": config.dtype,
            "backend": jax.default_backend(),
            "devices": jax.device_count(),
        }
    )


if __name__ == "__main__":
    main()
