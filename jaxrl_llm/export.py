"""Exports a trained run's policy as a Hugging Face checkpoint directory.

    python -m jaxrl_llm.export --workdir runs/X [--step N] --out DIR [--dtype bfloat16]

Reads the run's checkpoint (the latest step, or `--step`) and the config saved with it,
folds LoRA adapters into the base weights (the base is reloaded from where the run got
it: `model.pretrained`, `init.checkpoint` or the seeded random init), and writes
`config.json` + safetensors with `models.save_pretrained` (loadable by
`transformers.AutoModelForCausalLM.from_pretrained`). The tokenizer files the run used
are copied alongside.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys

import jax
import ml_collections

from jaxrl_llm import config as config_lib
from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.data.tokenizer import DEFAULT_MODEL_PATH
from jaxrl_llm.models import lora

# Files of a Hugging Face tokenizer directory worth carrying over with the weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def _base_params(config: ml_collections.ConfigDict, model):
    """The run's initial (base) weights, recreated exactly as `trainer.setup` made them."""
    from jaxrl_llm import trainer

    pretrained = config_lib.pretrained_dir(config)
    if pretrained is not None:
        from jaxrl_llm.models import hf

        return hf.load_pretrained(pretrained, dtype=model.param_dtype)[1]
    key = jax.random.fold_in(jax.random.key(config.seed), 1)
    return trainer.load_initial_params(config, model, key)


def policy_params(workdir: str | pathlib.Path, step: int | None = None):
    """(config, ModelConfig without adapters, params with adapters merged, step) of a run."""
    ckpt = Checkpointer(pathlib.Path(workdir) / "checkpoints")
    try:
        step = ckpt.latest_step() if step is None else step
        state, meta = ckpt.read(step)
    finally:
        ckpt.close()
    if "config" not in meta:
        raise ValueError(f"{workdir}: the checkpoint of step {step} has no saved config")
    config = ml_collections.ConfigDict(meta["config"])
    model = config_lib.model_config(config)
    params = state["params"]
    if model.lora_rank:
        params = lora.merge(lora.combine(params, _base_params(config, model)), model)
        model = model.replace(lora_rank=0)
    return config, model, params, step


def export(
    workdir: str | pathlib.Path,
    out: str | pathlib.Path,
    *,
    step: int | None = None,
    dtype: str | None = None,
) -> pathlib.Path:
    """Writes the run's policy at `step` (default: latest) to `out`; returns `out`."""
    from jaxrl_llm.models import hf

    config, model, params, step = policy_params(workdir, step)
    if dtype is not None:
        model = model.replace(param_dtype=dtype)
        params = jax.tree.map(lambda x: x.astype(model.jnp_param_dtype), params)
    out = pathlib.Path(out)
    hf.save_pretrained(out, model, params)
    source = config.data.tokenizer or config.model.pretrained
    if not source:
        shutil.copy(DEFAULT_MODEL_PATH, out / "tokenizer.model")
    else:
        source = pathlib.Path(source).expanduser()
        if source.is_file():
            shutil.copy(source, out / source.name)
        else:
            for name in TOKENIZER_FILES:
                if (source / name).is_file() and not (out / name).exists():
                    shutil.copy(source / name, out / name)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="the run's directory")
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument("--step", type=int, default=None, help="default: the latest")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    args = parser.parse_args(argv)
    try:
        out = export(args.workdir, args.out, step=args.step, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.workdir} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
