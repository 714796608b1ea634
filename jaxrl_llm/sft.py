"""Supervised warm start: teach a policy the answer format of a built-in task.

    python -m jaxrl_llm.sft --config configs/sft_arithmetic.py [--output PATH]

RL on a sparse 0/1 reward cannot start from a random policy (it never samples a correct,
well-formed answer), so the quickstart starts from a base policy made here: teacher
forcing on `prompt -> <answer>ANSWER</answer> EOS` with a token-mean cross-entropy. The
result is a safetensors file (`checkpoint.save_params_safetensors`).

Demonstrations can be made noisy the way real ones are: with `sft.carry_error_rate = q`,
a fraction q of the addition answers that need a carry are written with the carry
forgotten (58+67 -> 15 instead of 125). The base policy then puts real probability on
both the right and the systematically wrong answer, the situation RL with a verifiable
reward is good at fixing: it shifts the mass to the answers the verifier accepts.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags, logging
from ml_collections import config_flags

from jaxrl_llm import config as config_lib
from jaxrl_llm import configs
from jaxrl_llm.checkpoint import save_params_safetensors
from jaxrl_llm.data import Tokenizer, format_answer, make_pipeline, tasks
from jaxrl_llm.models import init_params
from jaxrl_llm.train_step import TrainBatch, completion_logps, make_optimizer


def no_carry_sum(a: int, b: int) -> int:
    """a + b computed digit by digit with every carry dropped (58 + 67 -> 15)."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def sft_records(config: ml_collections.ConfigDict, num_examples: int) -> list[dict]:
    """Demonstrations from the task generator, optionally noisy.

    Draws `num_examples` train-split problems and keeps those in `sft.split` ("sft": the
    half RL never trains on, `tasks.part_of`; "train": all), so about half are kept for
    "sft"; the pipeline cycles over them.
    """
    task, _, level = config.data.source.partition("/")
    difficulty = int(level.removeprefix("level") or 1)
    canonical_key = tasks.get_task(task).canonical_key
    rng = np.random.default_rng(config.seed)
    q = config.sft.carry_error_rate
    out = []
    for ex in tasks.generate(
        task, split="train", num_examples=num_examples, difficulty=difficulty, seed=config.seed
    ):
        answer = ex["answer"]
        if q and "+" in ex["prompt"] and rng.random() < q:
            a, b = (int(x) for x in ex["prompt"].rstrip("=").split("+"))
            answer = str(no_carry_sum(a, b))
        if config.sft.split != "train" and tasks.part_of(canonical_key(ex)) != config.sft.split:
            continue
        metadata = {k: v for k, v in ex.items() if k not in ("prompt", "answer")}
        out.append(
            {"prompt": ex["prompt"], "answer": answer, "metadata": {"task": task, **metadata}}
        )
    return out


def targets_for(tokenizer: Tokenizer, answers, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded target ids [B, length] (answer span + EOS) and their mask."""
    ids = np.full((len(answers), length), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(answers), length), bool)
    for i, answer in enumerate(answers):
        seq = tokenizer.encode(format_answer(answer), add_eos=True)[:length]
        ids[i, : len(seq)] = seq
        mask[i, : len(seq)] = True
    return ids, mask


def make_sft_step(model, optimizer):
    def loss_fn(params, batch: TrainBatch):
        logps, _ = completion_logps(params, model, batch, 1.0)
        w = batch.loss_weights
        return -jnp.sum(logps * w) / jnp.maximum(jnp.sum(w), 1.0)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def run_sft(config: ml_collections.ConfigDict, output: str, log=print) -> dict:
    """Trains for `config.sft.steps` and writes the params to `output`. Returns metrics."""
    config_lib.validate(config)
    model = config_lib.model_config(config)
    tok = Tokenizer.load()
    s = config.sft
    data = iter(
        make_pipeline(
            sft_records(config, 2 * s.steps * s.batch_size),
            tok,
            batch_size=s.batch_size,
            prompt_len=config.data.prompt_len,
            seed=config.seed,
            template=config.data.template,
        )
    )
    params = init_params(model, jax.random.key(config.seed))
    optimizer = make_optimizer(
        learning_rate=s.learning_rate,
        total_steps=s.steps,
        warmup_steps=s.warmup_steps,
        schedule="cosine",
        weight_decay=s.weight_decay,
    )
    opt_state = optimizer.init(params)
    step_fn = jax.jit(make_sft_step(model, optimizer), donate_argnums=(0, 1))
    t = config.sampling.max_new_tokens
    t0, loss = time.perf_counter(), float("nan")
    for i in range(s.steps):
        pb = next(data)
        ids, mask = targets_for(tok, pb.answers, t)
        batch = TrainBatch(
            tokens=jnp.asarray(np.concatenate([pb.tokens, ids], 1)),
            attention_mask=jnp.asarray(np.concatenate([pb.mask, mask], 1)),
            loss_weights=jnp.asarray(mask, jnp.float32),
            advantages=jnp.zeros((len(ids),), jnp.float32),
            old_logps=jnp.zeros(ids.shape, jnp.float32),
            ref_logps=jnp.zeros(ids.shape, jnp.float32),
        )
        params, opt_state, loss = step_fn(params, opt_state, batch)
        if (i + 1) % max(s.steps // 10, 1) == 0:
            log(f"sft step {i + 1}/{s.steps} loss {float(loss):.4f}")
    save_params_safetensors(output, params)
    return {"sft/loss": float(loss), "sft/seconds": time.perf_counter() - t0}


_CONFIG = config_flags.DEFINE_config_file("config", None, "SFT config file.", lock_config=True)
_OUTPUT = flags.DEFINE_string("output", None, "Where to write the params (.safetensors).")
flags.mark_flags_as_required(["config", "output"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    print(json.dumps(run_sft(_CONFIG.value, _OUTPUT.value)))


if __name__ == "__main__":
    app.run(main, argv=configs.resolve_config_argv(sys.argv))
