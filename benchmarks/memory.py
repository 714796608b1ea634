"""Per-device memory of the compiled train step and sampler, with and without LoRA.

    python -m benchmarks.memory [--layers 24] [--prompts 2 --group 4 --prompt-len 128 ...]

Builds the trainer's own stages (`jaxrl_llm.stages.build_stages`) for a
Qwen2.5-0.5B-shaped model (vocab 151936, D 896, 24 layers, 14/2 heads, F 4864, QKV bias,
tied embeddings; random shapes only: nothing is initialised or downloaded), lowers and
compiles the update and the sampler on abstract inputs, and prints one JSON line per
variant from XLA's `memory_analysis()` of the compiled executables:

- full_bf16: bfloat16 parameters and compute, AdamW moments in bfloat16 too;
- full_fp32_master: float32 master weights and moments, bfloat16 compute;
- lora_bf16: frozen bfloat16 base, rank-r float32 adapters (and their moments) on every
  projection, bfloat16 compute.

Each line: state bytes (trained params + optimizer state), frozen bytes, and for the
update and the sampler the argument, output, temporary and aliased (donated) bytes and
their peak = argument + output + temp - alias. `--remat full` (config `train.remat`) keeps
only each layer's input for the backward pass. Compiling the 24-layer step takes a few
minutes per variant on a 2-core CPU; `--layers` shrinks it.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import emit
from jaxrl_llm import sharding, stages
from jaxrl_llm.models import ModelConfig, lora
from jaxrl_llm.sampler import SamplingConfig
from jaxrl_llm.train_step import LossConfig, TrainBatch, TrainState, make_optimizer
from jaxrl_llm.transforms import chain, group_advantages

VARIANTS = {
    "full_bf16": dict(param_dtype="bfloat16", dtype="bfloat16", lora_rank=0),
    "full_fp32_master": dict(param_dtype="float32", dtype="bfloat16", lora_rank=0),
    "lora_bf16": dict(param_dtype="bfloat16", dtype="bfloat16"),
}


def _bytes(tree) -> int:
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _analysis(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    out = {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
    }
    out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def measure(model: ModelConfig, args: argparse.Namespace, targets=tuple(lora.TARGETS)) -> dict:
    """Compiles update and sampler for `model` on abstract inputs; returns the byte counts."""
    p, g, lp, t = args.prompts, args.group, args.prompt_len, args.new_tokens
    n = p * g
    mesh = sharding.make_mesh(data=jax.device_count())
    sampling = SamplingConfig(max_new_tokens=t, temperature=1.0)
    optimizer = make_optimizer(learning_rate=1e-5, total_steps=100)
    estimator = chain(group_advantages("grpo"))
    st = stages.build_stages(
        model=model,
        sampling=sampling,
        greedy=sampling,
        eval_sampling=sampling,
        loss=LossConfig(micro_batch_size=args.micro_batch),
        chain=estimator,
        optimizer=optimizer,
        group_size=g,
        mesh=mesh,
        rules=sharding.DEFAULT_RULES,
        lora_targets=targets if model.lora_rank else (),
    )

    def abstract(tree, shardings):
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
        )

    params = abstract(jax.eval_shape(st.init_params), st.param_shardings)
    trained, frozen = st.split(params)
    rep = st.replicated
    state = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
        params=trained,
        opt_state=abstract(jax.eval_shape(optimizer.init, trained), st.state_shardings.opt_state),
        rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep),
        transform_state=(),
    )

    def rows(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=st.rows)

    batch = TrainBatch(
        tokens=rows((n, lp + t), jnp.int32),
        attention_mask=rows((n, lp + t), jnp.bool_),
        loss_weights=rows((n, t), jnp.float32),
        advantages=rows((n,), jnp.float32),
        old_logps=rows((n, t), jnp.float32),
        ref_logps=rows((n, t), jnp.float32),
    )
    update = st.update.lower(state, batch, frozen).compile()
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)
    sample = st.generate.lower(
        params, rows((n, lp), jnp.int32), rows((n, lp), jnp.bool_), key
    ).compile()
    return {
        "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
        "trained_params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trained)),
        "state_bytes": _bytes((state.params, state.opt_state)),
        "frozen_bytes": _bytes(frozen),
        "update": _analysis(update),
        "sample": _analysis(sample),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24, help="Qwen2.5-0.5B has 24")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=0, help="rows per micro-batch; 0 = all")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument(
        "--remat", default="none", help="train.remat: none, full or a jax.checkpoint policy name"
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    args = p.parse_args(argv)
    for name in args.variants.split(","):
        if name not in VARIANTS:
            p.error(f"--variants: unknown {name!r}; known: {', '.join(VARIANTS)}")
        options = dict(lora_rank=args.lora_rank, lora_alpha=2.0 * args.lora_rank, remat=args.remat)
        options.update(VARIANTS[name])
        model = ModelConfig.qwen2_5_0_5b(n_layers=args.layers, vocab_size=args.vocab, **options)
        out = measure(model, args)
        emit(
            {
                "benchmark": "memory",
                "variant": name,
                "devices": jax.device_count(),
                "backend": jax.default_backend(),
                "layers": args.layers,
                "rows": args.prompts * args.group,
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "lora_rank": model.lora_rank,
                "remat": model.remat,
                **{k: v for k, v in out.items() if not isinstance(v, dict)},
                **{f"update_{k}_bytes": v for k, v in out["update"].items()},
                **{f"sample_{k}_bytes": v for k, v in out["sample"].items()},
            }
        )


if __name__ == "__main__":
    main()
