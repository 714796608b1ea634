"""Asynchronous training with bounded staleness (`jaxrl_llm.async_train`): the fixed
schedule (K = 0 is the synchronous trainer, K = 1 trains each batch one version late),
exact resume with the in-flight batches in the checkpoint, errors of the sampler thread,
and a rollout mesh of its own."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from jaxrl_llm import async_train, metrics, trainer
from tests.conftest import load_config
from tests.test_trainer import (  # noqa: F401 - the module-wide compilation cache fixture
    ROOT,
    VOLATILE,
    rich_config,
    shared_compilation_cache,
    shrink,
    stable,
)
from tests.test_trainer import run as run_sync


def async_config(data_dir, steps, k, **rl_async):
    c = rich_config(data_dir, steps=steps)  # the policy moves every step
    c.rl.asynchronous.update(max_staleness=k, **rl_async)
    c.train.update(eval_every=0, checkpoint_every=2)
    return c


def run_async(config, workdir) -> dict[int, dict]:
    """`train_async` on a fresh setup; the metrics JSONL as {step: merged record}."""
    run = trainer.setup(config)
    try:
        async_train.train_async(run, str(workdir))
    finally:
        run.reward_fns.close()
    return {r["step"]: r for r in metrics.by_step(metrics.read_metrics(workdir))}


def no_sampler_thread():
    return not any(t.name == "jaxrl-async-sampler" for t in threading.enumerate())


@pytest.fixture(scope="module")
def whole_k1(data_dir, tmp_path_factory):
    """An uninterrupted K = 1 run of 4 steps."""
    return run_async(async_config(data_dir, 4, 1), tmp_path_factory.mktemp("whole_k1"))


def test_schedule():
    assert [async_train.policy_version(s, 0) for s in range(4)] == [0, 1, 2, 3]
    assert [async_train.policy_version(s, 2) for s in range(5)] == [0, 0, 0, 1, 2]


def test_staleness_zero_reproduces_the_synchronous_trainer(data_dir, tmp_path):
    def config():
        c = async_config(data_dir, 3, 0)
        c.train.eval_every = 2  # the evaluation path too
        return c

    want = run_sync(config(), tmp_path / "sync")
    got = run_async(config(), tmp_path / "async")
    assert sorted(got) == sorted(want) == [0, 1, 2, 3]
    for step in want:
        assert set(want[step]) <= set(got[step]), step
        assert stable(want[step]) == {k: got[step][k] for k in stable(want[step])}, step
    for step in (1, 2, 3):
        assert got[step]["async/staleness/max"] == 0
        assert got[step]["async/policy_version"] == step - 1
        assert "train/is_weight" not in got[step]  # on-policy: the plain PPO objective
    assert no_sampler_thread()


def test_staleness_one_trains_each_batch_one_version_late(whole_k1):
    rows = whole_k1
    assert sorted(rows) == [1, 2, 3, 4]
    # Record `done` = step + 1; the batch of step s was sampled by version max(0, s - 1).
    assert [rows[d]["async/policy_version"] for d in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [rows[d]["async/staleness/mean"] for d in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert [rows[d]["async/staleness/max"] for d in (1, 2, 3, 4)] == [0, 1, 1, 1]
    for d in rows:
        assert np.isfinite(rows[d]["train/loss"])
        assert rows[d]["train/is_weight"] > 0
        assert 0 <= rows[d]["train/is_truncated_frac"] <= 1
    # Not vacuous: on-policy the behaviour weight is 1; a stale batch moves it.
    assert abs(rows[1]["train/is_weight"] - 1) < 1e-5
    assert max(abs(rows[d]["train/is_weight"] - 1) for d in (2, 3, 4)) > 1e-5
    assert no_sampler_thread()


def test_staleness_one_is_deterministic(data_dir, tmp_path, whole_k1):
    again = run_async(async_config(data_dir, 4, 1), tmp_path / "again")
    assert sorted(again) == sorted(whole_k1)
    for step in again:
        assert stable(again[step]) == stable(whole_k1[step]), step


def test_resumed_run_matches_uninterrupted_run(data_dir, tmp_path, whole_k1):
    # A finished run continued with more steps: its final checkpoint carries step 2's batch
    # (sampled by version 1).
    split = tmp_path / "split"
    run_async(async_config(data_dir, 2, 1), split)
    got = run_async(async_config(data_dir, 4, 1), split)
    logged = [r["step"] for r in metrics.read_metrics(split) if "train/loss" in r]
    assert logged == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert stable(got[step]) == stable(whole_k1[step]), step


def test_stopped_run_resumes_exactly(data_dir, tmp_path, whole_k1, monkeypatch):
    # A preemption (SIGTERM) after step 2 of 4: saved with the in-flight batch, resumed.
    workdir = tmp_path / "stopped"
    with monkeypatch.context() as m:
        m.setattr(trainer._StopRequest, "requested", lambda self, step: step == 2)
        first = run_async(async_config(data_dir, 4, 1), workdir)
    assert sorted(first) == [1, 2]
    got = run_async(async_config(data_dir, 4, 1), workdir)
    for step in (3, 4):
        assert stable(got[step]) == stable(whole_k1[step]), step
    assert no_sampler_thread()


def test_sampler_errors_reach_the_main_thread(data_dir, tmp_path, monkeypatch):
    collect = trainer.collect

    def failing(run, params, data_iter, state, step, timer):
        if step == 2:
            raise OSError("disk on fire")
        return collect(run, params, data_iter, state, step, timer)

    monkeypatch.setattr(trainer, "collect", failing)
    with pytest.raises(RuntimeError, match="asynchronous sampler failed") as info:
        run_async(async_config(data_dir, 4, 1), tmp_path / "error")
    assert isinstance(info.value.__cause__, OSError)
    assert no_sampler_thread()


_TWO_DEVICES = """
import json, sys
from jaxrl_llm import async_train, metrics, trainer
from tests.test_async import async_config

out = {}
for n in (0, 1):
    c = async_config(sys.argv[1], 3, 1, rollout_devices=n)
    run = trainer.setup(c)
    try:
        async_train.train_async(run, f"{sys.argv[2]}/{n}")
    finally:
        run.reward_fns.close()
    out[n] = metrics.by_step(metrics.read_metrics(f"{sys.argv[2]}/{n}"))
print(json.dumps(out))
"""


def test_rollout_devices_of_their_own_match_shared_devices(data_dir, tmp_path):
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu"
    )
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_DEVICES, data_dir, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared, split = json.loads(proc.stdout.strip().splitlines()[-1]).values()
    assert [r["step"] for r in shared] == [r["step"] for r in split] == [1, 2, 3]
    for a, b in zip(shared, split, strict=True):
        keys = [k for k in a if not k.startswith(VOLATILE)]
        assert set(keys) <= set(b)
        np.testing.assert_allclose(
            [a[k] for k in keys], [b[k] for k in keys], rtol=1e-4, atol=1e-6, err_msg=str(keys)
        )


@pytest.mark.parametrize("variant", ["dapo", "lora_kl"])
def test_dynamic_sampling_and_lora_run_asynchronously(data_dir, tmp_path, variant):
    if variant == "dapo":  # extra sampling rounds judged with the sampling version's chain
        c = shrink(load_config("dapo"), data_dir, steps=3)
    else:  # adapters published over the frozen base; the base is the KL reference
        c = shrink(load_config("quickstart"), data_dir, steps=3)
        c.lora.update(rank=4, alpha=8.0)
        c.loss.beta = 0.01
    c.rl.asynchronous.max_staleness = 1
    c.train.update(eval_every=0, checkpoint_every=0)
    rows = run_async(c, tmp_path / variant)
    assert sorted(rows) == [1, 2, 3]
    for d in rows:
        assert np.isfinite(rows[d]["train/loss"]) and rows[d]["train/is_weight"] > 0
    assert [rows[d]["async/staleness/max"] for d in (1, 2, 3)] == [0, 1, 1]
    if variant == "dapo":
        assert all("dynamic_sampling/rounds" in r for r in rows.values())
    assert no_sampler_thread()


def test_train_and_evaluate_dispatches_on_max_staleness(data_dir, tmp_path, whole_k1):
    got = run_sync(async_config(data_dir, 4, 1), tmp_path / "cli")
    assert stable(got[4]) == stable(whole_k1[4])
    assert got[4]["async/staleness/max"] == 1


def test_async_config_errors_name_the_key(data_dir):
    from jaxrl_llm import config as config_lib

    c = async_config(data_dir, 1, 1, rollout_devices=8)
    with pytest.raises(
        ValueError, match=r"config\.rl\.asynchronous\.rollout_devices: 8 leaves none"
    ):
        config_lib.validate(c)
