"""The RL loop, as flax's `train_and_evaluate`: set up once, then only loop.

`setup(config)` builds everything a run needs (mesh, data, compiled stages from
`stages.py`); `train_and_evaluate(config, workdir)` loops: prompts -> sample and score ->
chain -> update -> metrics / evaluation / checkpoints, until `train.steps` or a
SIGTERM / SIGINT, which finishes the step, saves and returns.

Multi-process runs: every process reads the same global batch of prompts and keeps its
own block of rows (reading prompts is negligible next to decoding them, and the global
batch, and so the run, then does not depend on the number of processes); completions are
decoded and scored on the process that holds them, and the stages run on global arrays, so
group statistics are exact. Only process 0 writes metrics and the progress line; Orbax
coordinates the checkpoint.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from jaxrl_llm import config as config_lib
from jaxrl_llm import evaluation, metrics, partial, stages, transforms
from jaxrl_llm import rewards as rewards_lib
from jaxrl_llm.checkpoint import Checkpointer, load_params_safetensors
from jaxrl_llm.data import (
    HFTokenizer,
    PromptBatch,
    Tokenizer,
    first_records,
    make_pipeline,
    make_source,
)
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.train_step import TrainState, make_optimizer


def _source(c: ml_collections.ConfigDict, key: str, spec: str, split: str):
    """`make_source`, with its errors naming the config key."""
    try:
        return make_source(
            spec,
            split,
            data_dir=c.data.data_dir or None,
            prompt_key=c.data.prompt_key or None,
            answer_key=c.data.answer_key or None,
        )
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ValueError(f"config.{key}: {spec!r}: {e}") from None


def load_initial_params(config: ml_collections.ConfigDict, model: ModelConfig, key, like=None):
    """The initial policy: the `init.checkpoint` file, or a random init from `key`.

    `like` (abstract params with shardings) places the loaded arrays shard by shard.
    """
    path = config_lib.resolve_checkpoint(config.init.checkpoint)
    if path is None:
        return init_params(model, key)
    if like is None:
        like = jax.eval_shape(lambda: init_params(model, key))
    return load_params_safetensors(path, like=like)


def _load_pretrained(path, model: ModelConfig, rules, like):
    """A Hugging Face checkpoint's weights in `model.param_dtype`, placed like `like`."""
    from jaxrl_llm.models import hf

    mesh = jax.tree.leaves(like)[0].sharding.mesh
    _, params = hf.load_pretrained(path, dtype=model.param_dtype, mesh=mesh, rules=rules)
    return jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), params, like)


@dataclasses.dataclass
class Run:
    """Everything `train_and_evaluate` loops over, built once by `setup`."""

    config: ml_collections.ConfigDict
    model: ModelConfig
    tokenizer: Tokenizer | HFTokenizer
    reward_names: tuple[str, ...]  # metric labels, one per reward column
    reward_fns: rewards_lib.RewardPool  # close() when the run ends
    chain: transforms.RolloutTransform
    stages: stages.Stages
    pipeline: Any  # grain IterDataset of global PromptBatches
    eval_batch: PromptBatch  # padded to a multiple of the row shards
    eval_rows: int  # real eval prompts (before padding)
    P: int
    G: int
    vade: Any = None  # data.vade.VadeSampler with data.sampler="vade", else None


def setup(config: ml_collections.ConfigDict) -> Run:
    """Validates the config (naming the first bad key) and builds the run's pieces."""
    config_lib.validate(config)
    c = config
    model = config_lib.model_config(c)
    tokenizer = config_lib.tokenizer(c)
    p, g = c.rl.prompts_per_step, c.rl.group_size
    chain = config_lib.chain(c)
    # Process 0 builds a missing TFDS dataset first: concurrent builds of one directory race.
    if jax.process_index() == 0:
        source = _source(c, "data.source", c.data.source, c.data.train_split)
    multihost_utils.sync_global_devices("jaxrl_llm: data prepared")
    if jax.process_index() != 0:
        source = _source(c, "data.source", c.data.source, c.data.train_split)
    if c.data.train_prompts:
        try:
            source = first_records(source, c.data.train_prompts)
        except ValueError as e:
            raise ValueError(f"config.data.train_prompts: {e}") from None
    chat = dict(
        system_prompt=c.data.system_prompt, chat_kwargs=dict(c.data.chat_template_kwargs) or None
    )
    vade_sampler = None
    if c.data.sampler == "vade":  # candidates from the stream; VADE keeps P of them
        from jaxrl_llm.data import vade

        vade_cfg = vade.VadeConfig(**c.data.vade.to_dict())
        vade_sampler = vade.VadeSampler(len(source), vade_cfg, g, seed=c.seed)
    pipeline = make_pipeline(
        source,
        tokenizer,
        batch_size=vade_sampler.cfg.num_candidates(p) if vade_sampler else p,
        prompt_len=c.data.prompt_len,
        seed=c.seed,
        template=c.data.template,
        shard_index=0,  # the global batch on every process; each keeps its rows
        shard_count=1,
        **chat,
    )
    eval_spec = c.data.eval_source or c.data.source
    key = "data.eval_source" if c.data.eval_source else "data.source"
    eval_source = _source(c, key, eval_spec, "test")
    n_eval = min(c.data.eval_prompts, len(eval_source))
    eval_batch = next(
        iter(
            make_pipeline(
                eval_source,
                tokenizer,
                batch_size=n_eval,
                prompt_len=c.data.prompt_len,
                shuffle=False,
                num_epochs=1,
                template=c.data.template,
                **chat,
                split="test",
                shard_index=0,  # every process holds the whole eval set, keeps its rows
                shard_count=1,
            )
        )
    )
    mesh = config_lib.make_mesh(c)
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    eval_batch = _pad_rows(eval_batch, -(-n_eval // shards) * shards)

    built = build_run_stages(c, model, tokenizer, chain, mesh)
    return Run(
        config=c,
        model=model,
        tokenizer=tokenizer,
        reward_names=config_lib.reward_labels(c),
        reward_fns=config_lib.reward_pool(c),
        chain=chain,
        stages=built,
        pipeline=pipeline,
        eval_batch=eval_batch,
        eval_rows=n_eval,
        P=p,
        G=g,
        vade=vade_sampler,
    )


def _take_rows(batch: PromptBatch, idx) -> PromptBatch:
    """The batch's rows `idx` (a host int array), in that order."""
    idx = np.asarray(idx)
    pick = lambda xs: tuple(xs[i] for i in idx) if xs else xs
    return batch.replace(
        tokens=np.asarray(batch.tokens)[idx],
        mask=np.asarray(batch.mask)[idx],
        lengths=np.asarray(batch.lengths)[idx],
        prompts=pick(batch.prompts),
        answers=pick(batch.answers),
        metadata=pick(batch.metadata),
        ids=pick(batch.ids),
    )


def next_prompts(run: Run, data_iter, step: int) -> PromptBatch:
    """The next P prompts: the stream's, or VADE's choice among its candidates."""
    batch = next(data_iter)
    if run.vade is None:
        return batch
    return _take_rows(batch, run.vade.select(np.asarray(batch.ids), run.P, step))


def build_run_stages(
    c: ml_collections.ConfigDict, model: ModelConfig, tokenizer, chain, mesh
) -> stages.Stages:
    """The run's compiled stages over `mesh` (setup's, and the asynchronous sampler's own
    rollout mesh): optimizer, samplers and initial-params loader from the config."""
    pretrained = config_lib.pretrained_dir(c)
    p, g = c.rl.prompts_per_step, c.rl.group_size
    loss = config_lib.loss_config(c)
    sampling = config_lib.sampling_config(c, tokenizer.eos_ids, tokenizer.pad_id)
    o = c.optim
    optimizer = make_optimizer(
        learning_rate=o.learning_rate,
        total_steps=c.train.steps * loss.num_iterations * loss.num_minibatches,
        warmup_steps=o.warmup_steps,
        schedule=o.schedule,
        weight_decay=o.weight_decay,
        b1=o.b1,
        b2=o.b2,
        max_grad_norm=o.max_grad_norm,
    )
    init_key = jax.random.fold_in(jax.random.key(c.seed), 1)
    load = None
    if pretrained is not None:
        load = lambda like: _load_pretrained(pretrained, model, c.mesh.rules, like)
    elif config_lib.resolve_checkpoint(c.init.checkpoint) is not None:
        load = lambda like: load_initial_params(c, model, init_key, like)
    return stages.build_stages(
        model=model,
        sampling=sampling,
        greedy=sampling.replace(temperature=0.0),
        eval_sampling=sampling.replace(temperature=c.train.eval_temperature),
        loss=loss,
        chain=chain,
        optimizer=optimizer,
        group_size=g,
        mesh=mesh,
        rules=c.mesh.rules,
        load_params=load,
        seed=c.seed,
        lora_targets=tuple(c.lora.targets) if c.lora.rank else (),
        engine=c.sampling.engine,
        slots=c.sampling.slots,
        kl_kind=c.rl.kl_in_reward.kind,
        partial_stop_groups=p if c.rl.partial_rollouts else 0,
    )


def _pad_rows(batch: PromptBatch, n: int) -> PromptBatch:
    """`batch` with rows repeated from the first up to `n` (padding is never counted)."""
    extra = n - batch.batch_size
    if not extra:
        return batch
    idx = np.concatenate([np.arange(batch.batch_size), np.zeros(extra, int)])
    return batch.replace(
        tokens=batch.tokens[idx],
        mask=batch.mask[idx],
        lengths=batch.lengths[idx],
        prompts=tuple(batch.prompts[i] for i in idx),
        answers=tuple(batch.answers[i] for i in idx),
        metadata=tuple(batch.metadata[i] for i in idx),
    )


def _repeated_rows(st: stages.Stages, batch: PromptBatch, repeat: int):
    """Each prompt `repeat` times in a row (group-major, [B * repeat, Lp]), as global arrays
    sharded by rows, with this process's rows' answers and metadata."""
    rows = stages.process_rows(batch.batch_size * repeat)
    tokens = np.repeat(np.asarray(batch.tokens), repeat, axis=0)[rows]
    mask = np.repeat(np.asarray(batch.mask), repeat, axis=0)[rows]
    answers = [a for a in batch.answers for _ in range(repeat)][rows]
    meta = [m for m in batch.metadata for _ in range(repeat)][rows]
    return stages.to_global(tokens, st.rows), stages.to_global(mask, st.rows), answers, meta


def _sample_round(run: Run, params, batch: PromptBatch, key, timer, step: int = 0):
    """G completions of each of the batch's P prompts, scored on the rows' own processes;
    with VADE, the prompts' posteriors are updated from the first reward (data.vade).

    Returns (Scored, {metric: count}): the reward failures (errors, non-finite values,
    timeouts) per reward, summed over processes."""
    st = run.stages
    prompts, prompt_mask, answers, meta = _repeated_rows(st, batch, run.G)
    rollout, result = stages.decode_and_score(
        st.generate,
        params,
        prompts,
        prompt_mask,
        stages.key_data(key, st.replicated),
        answers=answers,
        metadata=meta,
        reward_fns=run.reward_fns,
        decode=run.tokenizer.decode,
        timer=timer,
    )
    scored = stages.Scored(
        batch=st.to_batch(prompts, prompt_mask, rollout),
        rewards=stages.to_global(result.rewards, st.rows),  # [N, K]
        truncated=rollout.truncated,
    )
    failures = result.metrics()
    if jax.process_count() > 1:
        names = sorted(failures)
        counts = np.asarray([failures[k] for k in names], np.float64)
        summed = multihost_utils.process_allgather(counts).sum(0)
        failures = dict(zip(names, summed.tolist()))
    if run.vade is not None:
        r = stages.to_host(scored.rewards).reshape(batch.batch_size, run.G, -1)[..., 0]
        run.vade.update(np.asarray(batch.ids), np.nan_to_num(r), step, valid=~np.isnan(r))
    return scored, failures


def collect(run: Run, params, data_iter, state: TrainState, step: int, timer):
    """One batch of P scored groups; with DAPO dynamic sampling, extra rounds replace the
    groups the chain would not train on (`stages.trained_groups`)."""
    key = jax.random.fold_in(jax.random.key(run.config.seed), step)
    scored, failures = _sample_round(
        run, params, next_prompts(run, data_iter, step), jax.random.fold_in(key, 0), timer, step
    )
    rounds = run.config.rl.dynamic_sampling_rounds
    if not rounds:
        return scored, failures
    st = run.stages
    parts, flags = [scored], [stages.to_host(st.trained_groups(scored, state.transform_state))]
    used = 0
    while sum(int(f.sum()) for f in flags) < run.P and used < rounds:
        used += 1
        extra, more = _sample_round(
            run,
            params,
            next_prompts(run, data_iter, step),
            jax.random.fold_in(key, used),
            timer,
            step,
        )
        failures = {k: failures.get(k, 0) + v for k, v in more.items()}
        parts.append(extra)
        flags.append(stages.to_host(st.trained_groups(extra, state.transform_state)))
    flag = np.concatenate(flags)  # bool[P * (used + 1)]
    have = int(flag.sum())
    # Trained groups first (in sampling order), then the first round's others as filler.
    order = np.concatenate([np.flatnonzero(flag), np.flatnonzero(~flag[: run.P])])[: run.P]
    merged = stages.concat(parts) if len(parts) > 1 else scored
    groups = stages.replicate(order.astype(np.int32), st.replicated)
    scored = jax.jit(stages.select_groups, static_argnums=2, out_shardings=st.rows)(
        merged, groups, run.G
    )
    info = failures | {
        "dynamic_sampling/rounds": used,
        "dynamic_sampling/shortfall": max(run.P - have, 0) / run.P,
    }
    return scored, info


def prepare(run: Run, state: TrainState, frozen, ref_params, scored: stages.Scored):
    """Policy passes the chain and the loss need, then the chain -> (batch, rollouts, state).

    `frozen`: the frozen base under LoRA (else {}); `ref_params`: the reference policy or
    None (no KL term).
    """
    st, c = run.stages, run.config
    batch, entropy, kl = scored.batch, None, None
    # Off-policy batches (behaviour log-probs from older policies: partial or asynchronous
    # rollouts) get the proximal policy's log-probs as old_logps (decoupled PPO).
    proximal = batch.behav_logps is not None
    # With one update per batch the loss takes the proximal log-probs from its own forward
    # (LossConfig.current_proximal): no pass here for them.
    pass_for_proximal = proximal and not (st.loss and st.loss.current_proximal)
    if "entropy" in run.chain.needs or c.rl.recompute_old_logps or pass_for_proximal:
        logps, entropy = st.policy_pass(st.policy(state, frozen), batch)
        if c.rl.recompute_old_logps or proximal:
            batch = batch.replace(old_logps=logps * batch.loss_weights)
    if ref_params is not None:  # the frozen reference policy
        ref_logps, _ = st.ref_pass(ref_params, batch)
        batch = batch.replace(ref_logps=ref_logps * batch.loss_weights)
        if "kl" in run.chain.needs:  # KL in the reward: of the sampling policy, as verl
            sampled = batch.behav_logps if proximal else batch.old_logps
            kl = st.token_kl(sampled, batch.ref_logps, batch.loss_weights)
    batch, ro, transform_state = st.chain(
        scored.replace(batch=batch), state.transform_state, entropy, kl
    )
    return batch, ro, state.replace(transform_state=transform_state)


def rollout_metrics(run: Run, scored: stages.Scored, ro) -> dict:
    """Reward, advantage, selection and length statistics of one step (global)."""
    out = {}
    r = stages.to_host(scored.rewards).reshape(run.P, run.G, -1)  # [P, G, K]
    for k, name in enumerate(run.reward_names):
        out |= metrics.summarize(f"reward/{name}", r[..., k], ~np.isnan(r[..., k]))
    valid = np.asarray(ro.valid)
    out["rollouts/invalid"] = float(1.0 - valid.mean())
    scores = np.asarray(ro.scores)  # the combined reward the chain's estimator saw
    out["reward/total/mean"] = float(scores[valid].mean()) if valid.any() else 0.0
    varies = [
        np.ptp(scores[i][valid[i]]) > 0 if valid[i].sum() > 1 else False for i in range(run.P)
    ]
    out["rollouts/zero_variance_groups"] = float(1.0 - np.mean(varies))
    active = np.asarray(ro.sample_weight) > 0
    out |= metrics.summarize("advantages", np.asarray(ro.advantages), active)
    out["rollouts/kept"] = float(active.mean())
    lengths = np.asarray(ro.lengths)  # completion tokens, before any token selection
    w = np.asarray(ro.loss_weights())
    out["tokens/kept"] = float((w > 0).sum() / max(lengths.sum(), 1))
    out |= metrics.summarize("completion/length", lengths.astype(np.float32))
    out["completion/truncated"] = float(np.asarray(ro.truncated).mean())
    return out


def evaluate(run: Run, params, step: int) -> dict:
    """Greedy accuracy and unbiased pass@k on the held-out prompts (padding excluded)."""
    c, st, eb = run.config, run.stages, run.eval_batch
    key = stages.key_data(jax.random.fold_in(jax.random.key(c.seed + 1), step), st.replicated)
    n = c.train.eval_samples

    def correct(fn, repeat):
        tokens, mask, answers, meta = _repeated_rows(st, eb, repeat)
        _, result = stages.decode_and_score(
            fn,
            params,
            tokens,
            mask,
            key,
            answers=answers,
            metadata=meta,
            reward_fns=("correct",),
            decode=run.tokenizer.decode,
        )
        ok = stages.to_global(np.nan_to_num(result.rewards[:, 0]) > 0.5, st.rows)
        return stages.to_host(ok).reshape(eb.batch_size, repeat)[: run.eval_rows]

    greedy = correct(st.greedy, 1)[:, 0]
    sampled = correct(st.eval_generate, n).sum(-1)
    k = c.train.pass_k
    return {
        "eval/accuracy": float(greedy.mean()),
        f"eval/pass@{k}": float(np.mean(evaluation.pass_at_k(n, sampled, k))),
        "eval/sample_accuracy": float(sampled.sum() / (n * len(sampled))),
    }


def end_step(run, policy, ro, record, elapsed, done, final, writer, progress, last) -> dict:
    """The end of step `done`: throughput, evaluation when due, the metrics line and the
    progress bar; returns `last` updated with `record` (shared with async_train)."""
    c = run.config
    record["throughput/tokens_per_s"] = float(np.asarray(ro.lengths).sum() / elapsed)
    if c.train.eval_every and (done % c.train.eval_every == 0 or final):
        record |= evaluate(run, policy, done)
    if writer and c.train.log_every and (done % c.train.log_every == 0 or final):
        writer.write(done, record)
    last = {**last, **record}
    progress.update(
        done,
        reward=record["reward/total/mean"],
        acc=last.get("eval/accuracy", float("nan")),
        tok_s=record["throughput/tokens_per_s"],
    )
    return last


class _StopRequest:
    """Remembers a SIGTERM / SIGINT so the loop can finish its step, save and return."""

    def __init__(self):
        self.signal: int | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. a notebook worker): no handler
                pass
        return self

    def _handle(self, signum, frame):
        self.signal = signum

    def requested(self, step: int) -> bool:
        """Whether any process was signalled; all processes agree, so all stop together.

        Under `jax.distributed`, JAX's own preemption notice (it catches SIGTERM itself on
        cluster schedulers) counts too, through its sync point at `step`.
        """
        flag = self.signal is not None
        if jax.process_count() > 1:
            flag = bool(multihost_utils.process_allgather(np.asarray(flag)).any())
            try:
                flag = multihost_utils.reached_preemption_sync_point(step) or flag
            except RuntimeError:  # the runtime was started without its preemption service
                pass
        return flag

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains the policy described by `config`, writing metrics and checkpoints to workdir.

    Returns the last logged metrics (including the final evaluation).
    """
    run = setup(config)
    try:
        return _train(run, workdir)
    finally:
        run.reward_fns.close()


def _train(run: Run, workdir: str) -> dict:
    c, st = run.config, run.stages
    if c.rl.asynchronous.max_staleness:  # sampling overlaps the update (async_train)
        from jaxrl_llm import async_train

        return async_train.train_async(run, workdir)
    main = jax.process_index() == 0
    trained, frozen = st.split(st.init_params())
    # The reference is the initial policy. Under LoRA that is the frozen base itself (no
    # copy); otherwise it is created again (its own buffers: the update donates the
    # policy's).
    if not (c.loss.beta or c.rl.kl_in_reward.beta):
        ref_params = None
    else:
        ref_params = frozen if st.lora else st.init_params()
    state = st.init_state(trained, run.chain.init(config_lib.example_rollouts(c)))
    data_iter = iter(run.pipeline)
    ckpt = Checkpointer(f"{workdir}/checkpoints")
    start, pool = 0, None  # pool: partial rollouts waiting for the next step
    if ckpt.latest_step() is not None:  # restored onto this run's mesh (Orbax reshards)
        state, data_state, _ = ckpt.restore(target_state=state)
        texts = data_state.pop(partial.DATA_KEY, None)
        carried = ckpt.read_extra() or {}
        if c.rl.partial_rollouts and texts is not None:
            pool = partial.Pool.restore(carried["pool"], texts)
        if run.vade is not None and "vade" in carried:
            run.vade.load_state_dict(carried["vade"])
        data_iter.set_state(data_state)
        start = int(ckpt.latest_step())
        if main:
            print(f"resuming {workdir} from step {start}", file=sys.stderr)
    writer = metrics.MetricsWriter(workdir) if main else None
    progress = metrics.Progress(c.train.steps, enabled=c.train.progress and main)
    last: dict = {}
    if start == 0 and c.train.eval_every:
        last = evaluate(run, st.policy(state, frozen), 0)
        if writer:
            writer.write(0, last)
    done, stopped = start, False
    with _StopRequest() as stop:
        for step in range(start, c.train.steps):
            timer = metrics.StageTimer()
            t0 = time.perf_counter()
            policy = st.policy(state, frozen)
            if c.rl.partial_rollouts:
                scored, pool, info = partial.collect(run, policy, data_iter, pool, step, timer)
            else:
                scored, info = collect(run, policy, data_iter, state, step, timer)
            with timer("prepare") as stage:
                batch, ro, state = stage.block(prepare(run, state, frozen, ref_params, scored))
            with timer("update"):
                state, train_metrics = st.update(state, batch, frozen)
                train_metrics = stages.to_host_tree(train_metrics)
            elapsed = time.perf_counter() - t0
            record = {f"train/{k}": float(v) for k, v in train_metrics.items()}
            record |= rollout_metrics(run, scored, ro) | info | timer.results()
            record["time/step_s"] = elapsed
            if run.vade is not None:
                record |= run.vade.metrics()
            if c.rl.kl_in_reward.beta:  # the chain's first transform (config_lib.chain)
                kl_state = stages.to_host_tree(state.transform_state[0])
                record["kl_in_reward/beta"] = float(kl_state.beta)
                record["kl_in_reward/kl"] = float(kl_state.kl)
            done = step + 1
            final = done == c.train.steps
            last = end_step(
                run,
                st.policy(state, frozen),
                ro,
                record,
                elapsed,
                done,
                final,
                writer,
                progress,
                last,
            )
            every = c.train.checkpoint_every
            stopped = stop.requested(done) and not final
            if (every and done % every == 0) or final or stopped:
                data_state, extra = data_iter.get_state(), {}
                if pool is not None:
                    data_state = {**data_state, partial.DATA_KEY: pool.texts()}
                    extra["pool"] = pool.arrays()
                if run.vade is not None:
                    extra["vade"] = run.vade.state_dict()
                meta = {"config": c.to_dict()}
                ckpt.save(done, state, data_state, meta, extra=extra or None, force=True)
            if stopped:
                break
    progress.close()
    ckpt.wait()
    ckpt.close()
    if writer:
        writer.close()
    if stopped and main:
        name = signal.Signals(stop.signal).name if stop.signal else "a signal to another process"
        print(f"stopped by {name} after step {done}: checkpoint saved in {workdir}/checkpoints")
    return last
