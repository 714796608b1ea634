"""One trainer on every mesh: meshes, processes, preemption and resharded restores.

Every run here is the real CLI (or `train_and_evaluate`) in a subprocess, on the quickstart
model from the shipped base policy (so rewards vary and the update moves the policy), with
8 fake CPU devices (`--xla_force_host_platform_device_count`): the first steps' loss,
reward and evaluation on meshes (data=8), (fsdp=8) and (data=2, fsdp=2, tensor=2), and on
2 processes x 4 devices, equal the 1-device run within float tolerance.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from jaxrl_llm import metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch" / "local_multihost.sh"
EIGHT = "--xla_force_host_platform_device_count=8"
# The quickstart (model, base policy, task) at test size: 8 prompts x 4 samples per step.
SMALL = (
    "--config.rl.prompts_per_step=8",
    "--config.data.eval_prompts=8",
    "--config.train.eval_every=2",
    "--config.train.eval_samples=2",
    "--config.train.pass_k=2",
    "--config.train.progress=False",
    "--config.optim.learning_rate=1e-3",
)
COMPARED = ("train/loss", "train/grad_norm", "train/kl", "reward/correct/mean", "eval/accuracy")
VOLATILE = ("time/", "throughput/")


def cli(workdir, data_dir, *extra, steps=2):
    return [
        sys.executable,
        "-m",
        "jaxrl_llm.train",
        "--config",
        "configs/quickstart.py",
        f"--workdir={workdir}",
        f"--config.data.data_dir={data_dir}",
        f"--config.train.steps={steps}",
        *SMALL,
        *extra,
    ]


def run(args, *, xla_flags="", timeout=600, **kw):
    env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, **kw
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def by_step(workdir) -> dict[int, dict]:
    return {r["step"]: r for r in metrics.by_step(metrics.read_metrics(workdir))}


def assert_close(got: dict, want: dict, keys=COMPARED, rtol=1e-4, atol=1e-5):
    assert sorted(got) == sorted(want)
    for step in want:
        for k in keys:
            if k in want[step]:
                assert got[step][k] == pytest.approx(want[step][k], rel=rtol, abs=atol), (step, k)


@pytest.fixture(scope="module")
def one_device(data_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("one")
    run(cli(work, data_dir))
    rows = by_step(work)
    # Not vacuous: rewards vary, the policy moves, the evaluation ran at steps 0 and 2.
    assert rows[1]["reward/correct/std"] > 0
    assert min(rows[s]["train/grad_norm"] for s in (1, 2)) > 0
    assert {"eval/accuracy"} <= rows[0].keys() & rows[2].keys()
    return rows


_MESHES_SCRIPT = """
import json, sys
import jax
from jaxrl_llm import metrics, sharding, stages, trainer
from tests.conftest import load_config

assert jax.device_count() == 8
data_dir, out = sys.argv[1], sys.argv[2]
for name, mesh in (("data8", dict(data=8)), ("fsdp8", dict(data=1, fsdp=8))):
    c = load_config("quickstart")
    c.mesh.update(mesh)
    c.rl.prompts_per_step = 8
    c.data.update(eval_prompts=8, data_dir=data_dir)
    c.train.update(steps=2, eval_every=2, eval_samples=2, pass_k=2, progress=False)
    c.optim.learning_rate = 1e-3
    trainer.train_and_evaluate(c, f"{out}/{name}")
    if name == "fsdp8":  # per-device bytes of params + optimizer state
        run = trainer.setup(c)
        st = run.stages
        state = st.init_state(st.init_params(), ())
        b = sharding.shard_state_bytes((state.params, state.opt_state))
        json.dump(b, open(f"{out}/fsdp8_bytes.json", "w"))
print("ok")
"""


def test_meshes_equal_one_device(one_device, data_dir, tmp_path):
    # The must-hold CLI: --config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.tensor=2.
    mesh = ("--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2")
    run(cli(tmp_path / "ddt", data_dir, *mesh), xla_flags=EIGHT)
    assert_close(by_step(tmp_path / "ddt"), one_device)
    res = run([sys.executable, "-c", _MESHES_SCRIPT, data_dir, str(tmp_path)], xla_flags=EIGHT)
    assert res.stdout.strip().endswith("ok")
    for name in ("data8", "fsdp8"):
        assert_close(by_step(tmp_path / name), one_device)
    b = json.loads((tmp_path / "fsdp8_bytes.json").read_text())
    assert b["max_device_bytes"] <= b["total_bytes"] / 8 * 1.05, b


def test_two_processes_equal_one_process(data_dir, tmp_path):
    """With VADE prompt selection on: every process reads the global candidate batch and
    updates one shared table from the gathered rewards, so both select the same prompts."""
    mesh = ("--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2")
    mesh += ("--config.data.sampler=vade", "--config.data.vade.candidate_factor=2")
    run(cli(tmp_path / "one", data_dir, *mesh), xla_flags=EIGHT)
    run(["bash", str(LAUNCH), "2", "4", *cli(tmp_path / "two", data_dir, *mesh)])
    one, two = by_step(tmp_path / "one"), by_step(tmp_path / "two")
    assert sorted(one) == sorted(two) == [0, 1, 2]
    for step in one:  # same global batch, same program: the same numbers
        want = {k: v for k, v in one[step].items() if not k.startswith(VOLATILE)}
        got = {k: v for k, v in two[step].items() if not k.startswith(VOLATILE)}
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (step, k)
    assert one[2]["vade/never_seen"] < one[1]["vade/never_seen"] < 1  # the table filled
    # Only process 0 writes metrics: one record per step.
    assert [r["step"] for r in metrics.read_metrics(tmp_path / "two") if "train/loss" in r] == [
        1,
        2,
    ]


def _wait_for_step(workdir: pathlib.Path, step: int, proc, timeout=240) -> None:
    path = workdir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if path.exists() and any(
            json.loads(line).get("step", 0) >= step for line in path.read_text().splitlines()
        ):
            return
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s")


def _stable(rows):
    return {s: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for s, r in rows.items()}


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    """12 steps in one go (checkpoints do not change the metrics)."""
    whole = tmp_path_factory.mktemp("whole")
    run(cli(whole, data_dir, "--config.train.checkpoint_every=0", steps=12))
    return _stable(by_step(whole))


def test_sigterm_saves_and_rerun_resumes_exactly(uninterrupted, data_dir, tmp_path):
    steps = ("--config.train.checkpoint_every=0",)
    expected = uninterrupted

    work = tmp_path / "split"
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    args = cli(work, data_dir, *steps, steps=12)
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _wait_for_step(work, 3, proc)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert time.time() - t0 < 20
    line = next(x for x in out.splitlines() if x.startswith("stopped by SIGTERM"))
    stopped = int(line.split("after step ")[1].split(":")[0])
    assert 3 <= stopped < 12
    assert (work / "checkpoints" / str(stopped)).is_dir()

    res = run(args)
    assert f"resuming {work} from step {stopped}" in res.stderr
    got = _stable(by_step(work))
    assert sorted(got) == sorted(expected)
    for step in range(stopped + 1, 13):  # bit for bit on CPU
        assert got[step] == expected[step], step


def test_sigkill_during_saves_resumes_from_a_complete_checkpoint(uninterrupted, data_dir, tmp_path):
    every = ("--config.train.checkpoint_every=1",)  # a save (async) after every step
    expected = uninterrupted
    work = tmp_path / "killed"
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    args = cli(work, data_dir, *every, steps=12)
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    _wait_for_step(work, 4, proc)
    proc.kill()
    proc.wait(timeout=60)
    res = run(args)
    resumed = int(res.stderr.split(f"resuming {work} from step ")[1].split()[0])
    assert 1 <= resumed <= 12
    got = _stable(by_step(work))
    for step in range(resumed + 1, 13):
        assert got[step] == expected[step], step


_RESHARD_SCRIPT = """
import sys
import jax
from jaxrl_llm import trainer
from tests.conftest import load_config

data_dir, work, steps, mesh = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
c = load_config("quickstart")
c.mesh.update(dict(data=8) if mesh == "data" else dict(data=1, fsdp=8))
c.rl.prompts_per_step = 8
c.data.update(eval_prompts=8, data_dir=data_dir)
c.train.update(steps=steps, eval_every=2, eval_samples=2, pass_k=2, progress=False)
c.train.checkpoint_every = 2
c.optim.learning_rate = 1e-3
trainer.train_and_evaluate(c, work)
"""


def test_restore_onto_another_mesh(one_device, data_dir, tmp_path):
    def go(work, steps, mesh):
        run(
            [sys.executable, "-c", _RESHARD_SCRIPT, data_dir, str(work), str(steps), mesh],
            xla_flags=EIGHT,
        )

    go(tmp_path / "whole", 4, "data")
    go(tmp_path / "split", 2, "data")  # saved with the state replicated over data=8 ...
    go(tmp_path / "split", 4, "fsdp")  # ... restored sharded over fsdp=8
    whole, split = by_step(tmp_path / "whole"), by_step(tmp_path / "split")
    assert_close({s: split[s] for s in (3, 4)}, {s: whole[s] for s in (3, 4)})
    assert_close({s: whole[s] for s in (0, 1, 2)}, one_device)
