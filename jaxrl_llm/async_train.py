"""Asynchronous training with bounded staleness (`rl.asynchronous.max_staleness = K > 0`).

A background thread samples and scores batches ahead of the update while the main thread
runs the proximal pass, the transform chain and the update, AReaL-style: the batch of step
s is sampled by the policy after v(s) = max(0, s - K) updates, so it is at most K policy
versions old when it is trained on, and the update uses the decoupled PPO objective
(`TrainBatch.behav_logps` = the sampler's log-probs, `old_logps` recomputed by the
current, proximal, policy in `trainer.prepare`; the behaviour weight is capped by
`loss.is_cap`).

The schedule is fixed, not a race: step s always reads the data iterator's s-th batch,
uses `trainer.collect`'s PRNG key of step s and the params of version v(s), so a run does
not depend on thread timing, and K = 0 reproduces the synchronous trainer.

    main thread:    ... update s-1 -> publish v = s ->  prepare s, update s -> publish s+1
    sampler thread: ... sample s+K-1 (version s-1)  ->  sample s+K (version s) -> ...

Devices: `rl.asynchronous.rollout_devices = 0` samples on the training devices (the two threads'
programs interleave); n > 0 splits `jax.devices()` into a training mesh (the first ones)
and a rollout mesh (the last n): each published version is copied device to device onto
the rollout mesh, and each sampled batch back onto the training mesh's rows.

Checkpoints carry the batches already sampled for the next K steps (arrays in the `extra`
item, their policy versions and reward-failure counts in the data JSON under `DATA_KEY`)
and the data iterator's state after the last of them was read, so a resumed run equals an
uninterrupted one. The sampler always runs K batches past `train.steps`, so the final
checkpoint can be continued with a larger `train.steps` exactly as well (the price: K
sampled batches no step trains on at the end of a run).

Limits: one process only (both threads would issue cross-process collectives, in an
order that could differ between processes); not combined with `rl.partial_rollouts`. A
checkpoint written here resumes here (the in-flight batches ride in its data JSON); a
synchronous checkpoint resumes here too, its first K steps sampled by the restored policy.
"""

from __future__ import annotations

import copy
import dataclasses
import signal
import sys
import threading
import time
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import config as config_lib
from jaxrl_llm import losses, metrics, sharding, stages, trainer
from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.models import lora
from jaxrl_llm.train_step import TrainBatch

DATA_KEY = "async_inflight"  # in the checkpoint's data JSON: the in-flight batches' info
_BATCH_FIELDS = ("tokens", "attention_mask", "loss_weights", "advantages", "old_logps", "ref_logps")


def policy_version(step: int, max_staleness: int) -> int:
    """v(s): the number of updates behind the params that sample the batch of step s."""
    return max(0, step - max_staleness)


@dataclasses.dataclass
class _Sampled:
    scored: stages.Scored  # on the training mesh
    info: dict  # reward failures (and dynamic sampling) of `collect`
    version: int  # the policy version that sampled it
    times: dict  # the sampler's stage times (time/sample_s, time/score_s, ...)


# ------------------------------------------------------------------------------- devices


def _mesh_on(c, devices) -> jax.sharding.Mesh:
    """The config's mesh layout over `devices`; all of them on "data" if it does not fit."""
    try:
        sizes = config_lib.mesh_sizes(c, len(devices))
    except ValueError:
        sizes = dict(data=len(devices), fsdp=1, tensor=1)
    return sharding.make_mesh(**sizes, devices=devices)


def build_stages_on(run: trainer.Run, mesh: jax.sharding.Mesh) -> stages.Stages:
    """The run's stages compiled over another mesh (`trainer.build_run_stages`)."""
    return trainer.build_run_stages(run.config, run.model, run.tokenizer, run.chain, mesh)


def _row_shards(mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def split_runs(run: trainer.Run) -> tuple[trainer.Run, trainer.Run | None]:
    """(training run, rollout run or None): with rl.asynchronous.rollout_devices = n > 0, the run
    rebuilt over the first devices and a copy over the last n; else (run, None)."""
    c = run.config
    n = c.rl.asynchronous.rollout_devices
    if not n:
        return run, None
    devices = jax.devices()
    if n >= len(devices):
        raise ValueError(
            f"config.rl.asynchronous.rollout_devices: {n} leaves no training device of "
            f"{len(devices)}"
        )
    train_mesh = _mesh_on(c, devices[: len(devices) - n])
    roll_mesh = _mesh_on(c, devices[len(devices) - n :])
    rows = run.P * run.G
    for name, mesh in (("training", train_mesh), ("rollout", roll_mesh)):
        shards = _row_shards(mesh)
        if rows % shards:
            raise ValueError(
                f"config.rl.asynchronous.rollout_devices: the {rows} rollouts do not split over "
                f"the {shards} row shards of the {name} mesh {dict(mesh.shape)}"
            )
    st_train = build_stages_on(run, train_mesh)
    eval_batch = run.eval_batch
    shards = _row_shards(train_mesh)
    if eval_batch.batch_size % shards:
        eval_batch = trainer._pad_rows(eval_batch, -(-eval_batch.batch_size // shards) * shards)
    train_run = dataclasses.replace(run, stages=st_train, eval_batch=eval_batch)
    roll_run = dataclasses.replace(run, stages=build_stages_on(run, roll_mesh))
    return train_run, roll_run


# ------------------------------------------------------------------------------- sampler


class _Sampler:
    """The background thread: samples step j with version `version_of(j)` once that version
    is published, in step order, and hands back `_Sampled` batches and the data iterator's
    state after each step's read. Errors are re-raised in the main thread by `get`."""

    def __init__(self, run, data_iter, first: int, last: int, version_of, to_train):
        self._run, self._iter = run, data_iter
        self._first, self._last = first, last  # steps [first, last) are sampled
        self._version_of = version_of
        self._to_train = to_train  # Scored -> Scored on the training mesh
        self._cond = threading.Condition()
        self._versions: dict[int, tuple[Any, Any]] = {}  # version -> (policy, transform_state)
        self._results: dict[int, _Sampled] = {}
        self._data_states: dict[int, dict] = {}
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="jaxrl-async-sampler", daemon=True)

    # main thread ------------------------------------------------------------------------

    def start(self):
        self._thread.start()

    def publish(self, version: int, policy, transform_state) -> None:
        with self._cond:
            self._versions[version] = (policy, transform_state)
            self._cond.notify_all()

    def _wait(self, ready):
        with self._cond:
            while not ready():
                if self._error is not None:
                    raise RuntimeError("the asynchronous sampler failed") from self._error
                if not self._thread.is_alive():
                    raise RuntimeError("the asynchronous sampler stopped unexpectedly")
                self._cond.wait(timeout=1.0)

    def get(self, step: int) -> _Sampled:
        """The batch of `step` (waits for it) and forgets it, with the data states before
        step - 1's (a later checkpoint needs the state after step - 1's read or later)."""
        self._wait(lambda: step in self._results)
        with self._cond:
            for j in [j for j in self._data_states if j < step - 1]:
                del self._data_states[j]
            return self._results.pop(step)

    def peek(self, step: int) -> _Sampled:
        """The batch of `step` (waits for it), kept for `get`."""
        self._wait(lambda: step in self._results)
        return self._results[step]

    def data_state(self, step: int) -> dict:
        """The data iterator's state after step `step`'s read (waits for it); earlier ones
        are forgotten."""
        self._wait(lambda: step in self._data_states)
        with self._cond:
            for j in [j for j in self._data_states if j < step]:
                del self._data_states[j]
            return self._data_states[step]

    def close(self, timeout: float | None = None) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # sampler thread ---------------------------------------------------------------------

    def _loop(self):
        try:
            for j in range(self._first, self._last):
                v = self._version_of(j)
                with self._cond:
                    while v not in self._versions and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    policy, transform_state = self._versions[v]
                timer = metrics.StageTimer()
                # `collect` only reads `state.transform_state` (dynamic sampling's criterion).
                state = types.SimpleNamespace(transform_state=transform_state)
                scored, info = trainer.collect(self._run, policy, self._iter, state, j, timer)
                data_state = copy.deepcopy(self._iter.get_state())
                with timer("transfer"):
                    scored = jax.block_until_ready(self._to_train(scored))
                del policy, transform_state, state
                with self._cond:
                    self._results[j] = _Sampled(scored, info, v, timer.results())
                    self._data_states[j] = data_state
                    if j + 1 < self._last:  # versions no later step needs
                        keep = self._version_of(j + 1)
                        for u in [u for u in self._versions if u < keep]:
                            del self._versions[u]
                    self._cond.notify_all()
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()


# ------------------------------------------------------------------------------- checkpoint


def _scored_arrays(scored: stages.Scored) -> dict:
    b = scored.batch
    out = {f: getattr(b, f) for f in _BATCH_FIELDS}
    return out | {"rewards": scored.rewards, "truncated": scored.truncated}


def _scored_from(arrays: dict, rows) -> stages.Scored:
    put = lambda x: jax.device_put(np.asarray(x), rows)
    return stages.Scored(
        batch=TrainBatch(**{f: put(arrays[f]) for f in _BATCH_FIELDS}),
        rewards=put(arrays["rewards"]),
        truncated=put(arrays["truncated"]),
    )


# ------------------------------------------------------------------------------- training


def train_async(run: trainer.Run, workdir: str) -> dict:
    """Trains `run` with the sampler up to `rl.asynchronous.max_staleness` versions ahead.

    The contract of `trainer._train`: metrics JSONL (and TensorBoard) in `workdir`,
    evaluation every `train.eval_every` steps, checkpoints in `workdir/checkpoints`
    (resumed from the latest), SIGTERM / SIGINT finish the step, save and return; returns
    the last logged metrics. Besides the synchronous metrics, every step logs
    "async/staleness/mean" and "/max" (policy versions between the sampler and the
    update, over the trained tokens) and "async/policy_version"; with K > 0 the update
    also reports "train/is_weight" and "train/is_truncated_frac".
    """
    c = run.config
    k = int(c.rl.asynchronous.max_staleness)
    if jax.process_count() > 1:
        # Both threads would issue cross-process collectives, in an order that may differ
        # between processes.
        raise ValueError("config.rl.asynchronous: asynchronous training runs on one process only")
    if c.rl.partial_rollouts:
        raise ValueError(
            "config.rl.asynchronous.max_staleness: cannot be combined with partial_rollouts"
        )
    run_t, run_r = split_runs(run)
    st = run_t.stages
    st_r = run_r.stages if run_r is not None else st
    main = jax.process_index() == 0
    steps = c.train.steps

    trained, frozen = st.split(st.init_params())
    if not (c.loss.beta or c.rl.kl_in_reward.beta):
        ref_params = None
    else:
        ref_params = frozen if st.lora else st.init_params()
    state = st.init_state(trained, run_t.chain.init(config_lib.example_rollouts(c)))
    data_iter = iter(run_t.pipeline)
    ckpt = Checkpointer(f"{workdir}/checkpoints")
    start, carried = 0, {}
    if ckpt.latest_step() is not None:
        state, data_state, _ = ckpt.restore(target_state=state)
        saved = data_state.pop(DATA_KEY, None) or []
        data_iter.set_state(data_state)
        start = int(ckpt.latest_step())
        if saved:
            arrays = ckpt.read_extra()["inflight"]
            for i, entry in enumerate(saved):
                carried[int(entry["step"])] = _Sampled(
                    _scored_from(arrays[str(i)], st.rows),
                    dict(entry["info"]),
                    int(entry["version"]),
                    {},
                )
        if main:
            print(f"resuming {workdir} from step {start}", file=sys.stderr)
    # The sampler's schedule: after a resume, steps whose version predates the restored
    # state (none when the checkpoint carries its in-flight batches) use the restored one.
    first = start + len(carried)
    version_of = lambda j: max(policy_version(j, k), start)
    last = steps + k  # the final checkpoint carries the next K batches too

    # Publishing a version: a copy the update cannot donate away (on the rollout mesh when
    # it has its own devices); with K = 0 on shared devices the sampler is done with a
    # version before the update consumes it, so the params themselves are published.
    copies = k > 0 or run_r is not None
    if run_r is not None:
        roll_trained_sh, roll_frozen_sh = st_r.split(st_r.param_shardings)
        frozen_r = jax.device_put(frozen, roll_frozen_sh) if st.lora else {}

        def to_rollout(params, transform_state):
            return (
                jax.device_put(params, roll_trained_sh),
                jax.device_put(transform_state, st_r.replicated),
            )

        to_train = lambda scored: jax.device_put(scored, st.rows)
    else:
        frozen_r = frozen

        def to_rollout(params, transform_state):
            return jax.tree.map(jnp.copy, (params, transform_state))

        to_train = lambda scored: scored

    def publish(version: int):
        params, transform_state = state.params, state.transform_state
        if copies:
            params, transform_state = jax.block_until_ready(to_rollout(params, transform_state))
        policy = lora.combine(params, frozen_r) if st.lora else params
        sampler.publish(version, policy, transform_state)

    sampler = _Sampler(run_r or run_t, data_iter, first, last, version_of, to_train)
    for j, item in carried.items():
        sampler._results[j] = item
    if carried:  # the restored iterator has read the carried batches
        sampler._data_states[first - 1] = copy.deepcopy(data_iter.get_state())
    writer = metrics.MetricsWriter(workdir) if main else None
    progress = metrics.Progress(steps, enabled=c.train.progress and main)
    last_record: dict = {}
    done, stopped = start, False
    try:
        if start < steps and first < last:
            if version_of(first) == start:
                publish(start)
            sampler.start()
        if start == 0 and c.train.eval_every:
            last_record = trainer.evaluate(run_t, st.policy(state, frozen), 0)
            if writer:
                writer.write(0, last_record)
        with trainer._StopRequest() as stop:
            for step in range(start, steps):
                timer = metrics.StageTimer()
                t0 = time.perf_counter()
                with timer("wait"):
                    item = sampler.get(step)
                scored = item.scored
                if k > 0:  # off-policy: the sampler's log-probs are the behaviour policy's
                    scored = scored.replace(
                        batch=scored.batch.replace(behav_logps=scored.batch.old_logps)
                    )
                with timer("prepare") as stage:
                    batch, ro, state = stage.block(
                        trainer.prepare(run_t, state, frozen, ref_params, scored)
                    )
                with timer("update"):
                    state, train_metrics = st.update(state, batch, frozen)
                    train_metrics = stages.to_host_tree(train_metrics)
                if step + 1 < last and any(
                    version_of(j) == step + 1 for j in range(max(first, step + 1), last)
                ):
                    with timer("publish"):
                        publish(step + 1)
                elapsed = time.perf_counter() - t0
                record = {f"train/{key}": float(v) for key, v in train_metrics.items()}
                record |= trainer.rollout_metrics(run_t, scored, ro) | item.info
                record |= item.times | timer.results()
                record["time/step_s"] = elapsed
                mask = np.asarray(ro.loss_weights()) > 0
                lag = losses.staleness(
                    np.full(mask.shape, item.version, np.int32), np.int32(step), mask
                )
                record["async/staleness/mean"] = float(lag["mean"])
                record["async/staleness/max"] = float(lag["max"])
                record["async/policy_version"] = float(item.version)
                if c.rl.kl_in_reward.beta:
                    kl_state = stages.to_host_tree(state.transform_state[0])
                    record["kl_in_reward/beta"] = float(kl_state.beta)
                    record["kl_in_reward/kl"] = float(kl_state.kl)
                done = step + 1
                final = done == steps
                last_record = trainer.end_step(
                    run_t,
                    st.policy(state, frozen),
                    ro,
                    record,
                    elapsed,
                    done,
                    final,
                    writer,
                    progress,
                    last_record,
                )
                every = c.train.checkpoint_every
                stopped = stop.requested(done) and not final
                if (every and done % every == 0) or final or stopped:
                    # In flight: the batches of steps done..hi-1, sampled by older versions.
                    hi = max(min(done + k, last), min(first, last))
                    _save(ckpt, sampler, done, hi, state, c)
                if stopped:
                    break
    except BaseException:
        sampler.close(timeout=60.0)
        raise
    sampler.close()
    progress.close()
    ckpt.wait()
    ckpt.close()
    if writer:
        writer.close()
    if stopped and main:
        name = signal.Signals(stop.signal).name if stop.signal else "a signal to another process"
        print(f"stopped by {name} after step {done}: checkpoint saved in {workdir}/checkpoints")
    return last_record


def _save(ckpt, sampler: _Sampler, done: int, hi: int, state, c) -> None:
    """Checkpoint after `done` steps with the batches of steps done..hi-1 (sampled by older
    versions) and the data iterator's state after the last of them was read."""
    inflight = [(j, sampler.peek(j)) for j in range(done, hi)]
    data_state = dict(sampler.data_state(hi - 1))
    data_state[DATA_KEY] = [
        {"step": j, "version": item.version, "info": item.info} for j, item in inflight
    ]
    extra = None
    if inflight:
        extra = {
            "inflight": {
                str(i): _scored_arrays(item.scored) for i, (_, item) in enumerate(inflight)
            }
        }
    meta = {"config": c.to_dict()}
    ckpt.save(done, state, data_state, meta, extra=extra, force=True)
