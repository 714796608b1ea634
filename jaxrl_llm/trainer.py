"""The RL loop: the only module that knows every stage.

prompts (grain) -> sampler (jit) -> rewards (host) -> transform chain (jit) -> train step
(jit) -> metrics / evaluation / checkpoints. `train_and_evaluate(config, workdir)` runs it.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxrl_llm import config as config_lib
from jaxrl_llm import downsample, evaluation, metrics, rewards, transforms
from jaxrl_llm.checkpoint import Checkpointer, load_params_safetensors
from jaxrl_llm.data import Tokenizer, make_pipeline, make_source
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.sampler import make_generate_fn
from jaxrl_llm.train_step import (
    TrainBatch,
    TrainState,
    completion_logps,
    make_optimizer,
    make_train_step,
)
from jaxrl_llm.types import Rollouts


@dataclasses.dataclass
class Scored:
    """One sampled and scored batch of P groups of G rollouts (host + device arrays)."""

    prompt_tokens: np.ndarray  # int32[N, Lp], N = P * G, group-major
    prompt_mask: np.ndarray  # bool[N, Lp]
    tokens: np.ndarray  # int32[N, T] completion
    completion_mask: np.ndarray  # bool[N, T]
    logps: np.ndarray  # float32[N, T] sampler log-probs (temperature-scaled policy)
    lengths: np.ndarray  # int32[N]
    truncated: np.ndarray  # bool[N]
    rewards: np.ndarray  # float32[P, G, K], NaN = failed
    texts: list[str]  # [N] decoded completions

    def select(self, groups: np.ndarray, group_size: int) -> Scored:
        rows = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
        return Scored(
            *(getattr(self, f.name)[rows] for f in dataclasses.fields(self)[:7]),
            rewards=self.rewards[groups],
            texts=[self.texts[i] for i in rows],
        )

    @staticmethod
    def concat(parts: list[Scored]) -> Scored:
        fields = [f.name for f in dataclasses.fields(Scored)]
        out = {k: np.concatenate([getattr(p, k) for p in parts]) for k in fields[:-1]}
        return Scored(**out, texts=[t for p in parts for t in p.texts])


def _source(key: str, spec: str, split: str, data_dir):
    """`make_source`, with its errors naming the config key."""
    try:
        return make_source(spec, split, data_dir=data_dir)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ValueError(f"config.{key}: {spec!r}: {e}") from None


def load_initial_params(config: ml_collections.ConfigDict, model: ModelConfig, key):
    path = config_lib.resolve_checkpoint(config.init.checkpoint)
    if path is None:
        return init_params(model, key)
    return load_params_safetensors(path, like=jax.eval_shape(lambda: init_params(model, key)))


class Trainer:
    """Holds the compiled stage functions and runs the loop (see `train_and_evaluate`)."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        config_lib.validate(config)
        self.config = config
        self.workdir = workdir
        self.model = config_lib.model_config(config)
        self.loss_cfg = config_lib.loss_config(config)
        self.tokenizer = Tokenizer.load()
        if self.tokenizer.vocab_size != self.model.vocab_size:
            raise ValueError(
                f"config.model.vocab_size: {self.model.vocab_size} != the tokenizer's "
                f"{self.tokenizer.vocab_size}"
            )
        self.P, self.G = config.rl.prompts_per_step, config.rl.group_size
        self.T = config.sampling.max_new_tokens
        self.reward_names = tuple(config.rewards.names)
        self.reward_fns = config_lib.reward_fns(config)
        spec = [(name, dict(kwargs)) for name, kwargs in config.rl.transforms]
        self.chain = transforms.from_spec(spec)
        combine = [kw for name, kw in spec if name == "combine_rewards"]
        weights = combine[0].get("weights") if combine else None
        self.reward_weights = (
            np.ones(len(self.reward_names)) if weights is None else np.asarray(weights)
        )
        self.decoupled = bool(combine and combine[0].get("decoupled", False))
        self.needs_entropy = any(
            name == "keep_top_tokens" and kw.get("score", "adv_x_entropy") != "abs_adv"
            for name, kw in spec
        )
        data_dir = config.data.data_dir or None
        source = _source("data.source", config.data.source, config.data.train_split, data_dir)
        self.pipeline = make_pipeline(
            source,
            self.tokenizer,
            batch_size=self.P,
            prompt_len=config.data.prompt_len,
            seed=config.seed,
            template=config.data.template,
            shard_index=jax.process_index(),
            shard_count=jax.process_count(),
        )
        eval_spec = config.data.eval_source or config.data.source
        key = "data.eval_source" if config.data.eval_source else "data.source"
        eval_source = _source(key, eval_spec, "test", data_dir)
        n_eval = min(config.data.eval_prompts, len(eval_source))
        self.eval_batch = next(
            iter(
                make_pipeline(
                    eval_source,
                    self.tokenizer,
                    batch_size=n_eval,
                    prompt_len=config.data.prompt_len,
                    shuffle=False,
                    num_epochs=1,
                    template=config.data.template,
                    split="test",
                )
            )
        )
        s = config.sampling
        gen = dict(eos_ids=(self.tokenizer.eos_id,), pad_id=self.tokenizer.pad_id)
        self.sample_fn = jax.jit(
            make_generate_fn(
                self.model,
                max_new_tokens=self.T,
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p,
                **gen,
            )
        )
        self.greedy_fn = jax.jit(
            make_generate_fn(self.model, max_new_tokens=self.T, temperature=0.0, **gen)
        )
        self.eval_sample_fn = jax.jit(
            make_generate_fn(
                self.model, max_new_tokens=self.T, temperature=config.train.eval_temperature, **gen
            )
        )
        o = config.optim
        self.optimizer = make_optimizer(
            learning_rate=o.learning_rate,
            total_steps=config.train.steps
            * self.loss_cfg.num_iterations
            * self.loss_cfg.num_minibatches,
            warmup_steps=o.warmup_steps,
            schedule=o.schedule,
            weight_decay=o.weight_decay,
            b1=o.b1,
            b2=o.b2,
            max_grad_norm=o.max_grad_norm,
        )
        self.step_fn = jax.jit(
            make_train_step(self.model, self.loss_cfg, self.optimizer), donate_argnums=0
        )
        self.chain_fn = jax.jit(self.chain.apply)
        temperature = self.loss_cfg.temperature
        self.logps_fn = jax.jit(
            lambda params, batch: completion_logps(params, self.model, batch, temperature)
        )

    # ---- stages -----------------------------------------------------------------------------

    def init_state(self) -> tuple[TrainState, Any]:
        key = jax.random.key(self.config.seed)
        params = load_initial_params(self.config, self.model, jax.random.fold_in(key, 1))
        # A copy: the update donates state.params, which would delete shared buffers.
        ref_params = jax.tree.map(jnp.copy, params) if self.loss_cfg.beta else None
        example = config_lib.example_rollouts(self.config)
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.optimizer.init(params),
            rng=jax.random.key_data(jax.random.fold_in(key, 2)),
            transform_state=self.chain.init(example),
        )
        return state, ref_params

    def sample_and_score(self, params, batch, key, timer) -> Scored:
        """Samples G completions for each of the P prompts and scores them."""
        g = self.G
        prompts = np.repeat(np.asarray(batch.tokens), g, axis=0)  # [P * G, Lp] group-major
        mask = np.repeat(np.asarray(batch.mask), g, axis=0)
        with timer("sample"):
            ro = jax.device_get(self.sample_fn(params, prompts, mask, key))
        texts = [
            self.tokenizer.decode(ro.tokens[i, : ro.lengths[i]].tolist())
            for i in range(len(prompts))
        ]
        answers = [a for a in batch.answers for _ in range(g)]
        meta = [m for m in batch.metadata for _ in range(g)]
        with timer("score"):
            r = rewards.score(self.reward_fns, texts, ro.lengths, answers, meta)  # [N, K]
        return Scored(
            prompt_tokens=prompts,
            prompt_mask=mask,
            tokens=np.asarray(ro.tokens),
            completion_mask=np.asarray(ro.completion_mask),
            logps=np.asarray(ro.logps),
            lengths=np.asarray(ro.lengths),
            truncated=np.asarray(ro.truncated),
            rewards=r.reshape(len(batch.answers), g, -1).astype(np.float32),
            texts=texts,
        )

    def collect(self, params, data_iter, step: int, timer) -> tuple[Scored, dict]:
        """One batch of P groups; with dynamic sampling, refills zero-variance groups."""
        key = jax.random.fold_in(jax.random.key(self.config.seed), step)
        scored = self.sample_and_score(params, next(data_iter), jax.random.fold_in(key, 0), timer)
        info = {}
        rounds = self.config.rl.dynamic_sampling_rounds
        if rounds:
            informative = self._informative(scored)
            kept = [scored.select(np.flatnonzero(informative), self.G)]
            have, used = int(informative.sum()), 0
            while have < self.P and used < rounds:
                used += 1
                extra = self.sample_and_score(
                    params, next(data_iter), jax.random.fold_in(key, used), timer
                )
                good = np.flatnonzero(self._informative(extra))
                kept.append(extra.select(good, self.G))
                have += len(good)
            if have < self.P:  # fill with zero-variance groups; their weight becomes 0
                kept.append(scored.select(np.flatnonzero(~informative)[: self.P - have], self.G))
            merged = Scored.concat(kept)
            scored = merged.select(np.arange(self.P), self.G)
            info = {
                "dynamic_sampling/rounds": used,
                "dynamic_sampling/shortfall": max(self.P - have, 0) / self.P,
            }
        return scored, info

    def _informative(self, scored: Scored) -> np.ndarray:
        """bool[P]: groups whose combined reward varies (any reward varies, if decoupled)."""
        r = scored.rewards  # [P, G, K]
        valid = jnp.asarray(~np.isnan(r).any(-1))
        if self.decoupled:
            cols = [
                downsample.informative_groups(jnp.asarray(r[..., k]), valid)
                for k in range(r.shape[-1])
            ]
            return np.asarray(jnp.any(jnp.stack(cols), axis=0))
        total = np.einsum("pgk,k->pg", np.nan_to_num(r), self.reward_weights)
        return np.asarray(downsample.informative_groups(jnp.asarray(total), valid))

    def build_batch(self, state, ref_params, scored: Scored):
        """Transform chain + reference / entropy passes -> (TrainBatch, Rollouts, state)."""
        n = self.P * self.G
        batch = TrainBatch(
            tokens=jnp.asarray(np.concatenate([scored.prompt_tokens, scored.tokens], 1)),
            attention_mask=jnp.asarray(
                np.concatenate([scored.prompt_mask, scored.completion_mask], 1)
            ),
            loss_weights=jnp.asarray(scored.completion_mask, jnp.float32),
            advantages=jnp.zeros((n,), jnp.float32),
            old_logps=jnp.asarray(np.where(scored.completion_mask, scored.logps, 0.0)),
            ref_logps=jnp.zeros((n, self.T), jnp.float32),
        )
        entropy = None
        if self.needs_entropy or self.config.rl.recompute_old_logps:
            logps, ent = self.logps_fn(state.params, batch)
            entropy = ent.reshape(self.P, self.G, self.T)
            if self.config.rl.recompute_old_logps:
                batch = batch.replace(old_logps=logps * batch.loss_weights)
        if ref_params is not None:
            ref_logps, _ = self.logps_fn(ref_params, batch)
            batch = batch.replace(ref_logps=ref_logps * batch.loss_weights)
        ro = Rollouts.create(
            jnp.asarray(scored.rewards),
            token_mask=jnp.asarray(scored.completion_mask.reshape(self.P, self.G, self.T)),
            entropy=entropy,
            lengths=jnp.asarray(scored.lengths.reshape(self.P, self.G)),
            truncated=jnp.asarray(scored.truncated.reshape(self.P, self.G)),
        )
        ro, transform_state = self.chain_fn(ro, state.transform_state, state.step)
        batch = batch.replace(
            advantages=ro.advantages.reshape(n),
            loss_weights=ro.loss_weights().reshape(n, self.T),
        )
        return batch, ro, state.replace(transform_state=transform_state)

    def rollout_metrics(self, scored: Scored, ro: Rollouts) -> dict:
        out = {}
        r = scored.rewards  # [P, G, K]
        for k, name in enumerate(self.reward_names):
            out |= metrics.summarize(f"reward/{name}", r[..., k], ~np.isnan(r[..., k]))
        invalid = np.isnan(r).any(-1)
        out["rollouts/invalid"] = float(invalid.mean())
        total = np.nansum(r, -1)
        out["rollouts/zero_variance_groups"] = float(1.0 - self._informative(scored).mean())
        out["reward/total/mean"] = float(np.nanmean(total))
        active = np.asarray(ro.sample_weight) > 0
        out |= metrics.summarize("advantages", np.asarray(ro.advantages), active)
        out["rollouts/kept"] = float(active.mean())
        w = np.asarray(ro.loss_weights())
        out["tokens/kept"] = float((w > 0).sum() / max(scored.completion_mask.sum(), 1))
        out |= metrics.summarize("completion/length", scored.lengths.astype(np.float32))
        out["completion/truncated"] = float(scored.truncated.mean())
        return out

    def evaluate(self, params, step: int) -> dict:
        """Greedy accuracy and unbiased pass@k on the held-out prompts."""
        eb = self.eval_batch
        tokens, mask = np.asarray(eb.tokens), np.asarray(eb.mask)
        key = jax.random.fold_in(jax.random.key(self.config.seed + 1), step)
        greedy = jax.device_get(self.greedy_fn(params, tokens, mask, key))
        acc = self._correct(greedy, eb, 1)
        n = self.config.train.eval_samples
        sampled = jax.device_get(
            self.eval_sample_fn(
                params, np.repeat(tokens, n, axis=0), np.repeat(mask, n, axis=0), key
            )
        )
        correct = self._correct(sampled, eb, n).reshape(-1, n).sum(-1)
        k = self.config.train.pass_k
        return {
            "eval/accuracy": float(acc.mean()),
            f"eval/pass@{k}": float(np.mean(evaluation.pass_at_k(n, correct, k))),
            "eval/sample_accuracy": float(correct.sum() / (n * len(correct))),
        }

    def _correct(self, ro, eb, repeat: int) -> np.ndarray:
        texts = [
            self.tokenizer.decode(ro.tokens[i, : ro.lengths[i]].tolist())
            for i in range(ro.tokens.shape[0])
        ]
        answers = [a for a in eb.answers for _ in range(repeat)]
        meta = [m for m in eb.metadata for _ in range(repeat)]
        r = rewards.score(("correct",), texts, ro.lengths, answers, meta)
        return np.nan_to_num(r[:, 0]) > 0.5

    # ---- loop -------------------------------------------------------------------------------

    def run(self) -> dict:
        c = self.config
        state, ref_params = self.init_state()
        data_iter = iter(self.pipeline)
        ckpt = Checkpointer(f"{self.workdir}/checkpoints")
        start = 0
        if ckpt.latest_step() is not None:
            state, data_state, _ = ckpt.restore(target_state=state)
            data_iter.set_state(data_state)
            start = int(ckpt.latest_step())
            print(f"resuming {self.workdir} from step {start}", file=sys.stderr)
            if ref_params is not None:  # the reference is the initial policy, reloaded
                ref_params = self.init_state()[1]
        writer = metrics.MetricsWriter(self.workdir)
        progress = metrics.Progress(c.train.steps, enabled=c.train.progress)
        last: dict = {}
        if start == 0 and c.train.eval_every:
            last = self.evaluate(state.params, 0)
            writer.write(0, last)
        for step in range(start, c.train.steps):
            timer = metrics.StageTimer()
            t0 = time.perf_counter()
            scored, info = self.collect(state.params, data_iter, step, timer)
            with timer("prepare"):
                batch, ro, state = self.build_batch(state, ref_params, scored)
                jax.block_until_ready(batch)
            with timer("update"):
                state, train_metrics = self.step_fn(state, batch)
                train_metrics = jax.device_get(train_metrics)
            elapsed = time.perf_counter() - t0
            record = {f"train/{k}": float(v) for k, v in train_metrics.items()}
            record |= self.rollout_metrics(scored, ro) | info | timer.results()
            record["time/step_s"] = elapsed
            record["throughput/tokens_per_s"] = float(scored.lengths.sum() / elapsed)
            done = step + 1
            if c.train.eval_every and (done % c.train.eval_every == 0 or done == c.train.steps):
                record |= self.evaluate(state.params, done)
            if c.train.log_every and (done % c.train.log_every == 0 or done == c.train.steps):
                writer.write(done, record)
            last = {**last, **record}
            progress.update(
                done,
                reward=record["reward/total/mean"],
                acc=last.get("eval/accuracy", float("nan")),
                tok_s=record["throughput/tokens_per_s"],
            )
            every = c.train.checkpoint_every
            if (every and done % every == 0) or done == c.train.steps:
                ckpt.save(done, state, data_iter.get_state(), {"config": c.to_dict()})
        progress.close()
        ckpt.wait()
        ckpt.close()
        writer.close()
        return last


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains the policy described by `config`, writing metrics and checkpoints to workdir.

    Returns the last logged metrics (including the final evaluation).
    """
    return Trainer(config, workdir).run()
