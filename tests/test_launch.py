"""Multi-host start-up: jaxrl_llm.distributed.initialize and the launch/ scripts (dry runs, a
real 2-process CPU run with a cross-process sum, failure and signal handling)."""

import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxrl_llm import distributed

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOCAL = str(ROOT / "launch" / "local_multihost.sh")
TPU = str(ROOT / "launch" / "tpu_vm.sh")
SLURM = str(ROOT / "launch" / "gpu_slurm.sbatch")
# Anything that could make a subprocess (or initialize() here) believe it is in a cluster.
_CLUSTER_ENV = ("JAX_", "JAXRL_", "SLURM_", "OMPI_", "TPU_", "MEGASCALE_", "XLA_FLAGS")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLUSTER_ENV)}
    env["JAX_PLATFORMS"] = "cpu"
    return {**env, **extra}


def run(args, env=None, timeout=60, **kwargs):
    return subprocess.run(
        args,
        cwd=ROOT,
        env=clean_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


@pytest.fixture
def no_cluster(monkeypatch):
    for key in list(os.environ):
        if key.startswith(_CLUSTER_ENV):
            monkeypatch.delenv(key)
    return monkeypatch


# --- local_multihost.sh ---------------------------------------------------------------------


def test_local_dry_run_lists_every_process():
    env = clean_env(JAXRL_PORT="23456", XLA_FLAGS="--xla_dump_to=/tmp/x")
    proc = run([LOCAL, "--dry-run", "3", "2", "python", "-c", 'print("a b")'], env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3
    for i, line in enumerate(lines):
        words = shlex.split(line)
        assert words[0] == "env"
        assert words[-3:] == ["python", "-c", 'print("a b")']
        assert "XLA_FLAGS=--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2" in words
        assert "JAX_PLATFORMS=cpu" in words
        assert "JAX_COORDINATOR_ADDRESS=127.0.0.1:23456" in words
        assert "JAX_NUM_PROCESSES=3" in words
        assert f"JAX_PROCESS_ID={i}" in words


def test_local_dry_run_picks_one_free_port_for_all():
    proc = run([LOCAL, "--dry-run", "2", "1", "true"])
    assert proc.returncode == 0, proc.stderr
    ports = set(re.findall(r"JAX_COORDINATOR_ADDRESS=127\.0\.0\.1:(\d+)", proc.stdout))
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536


@pytest.mark.parametrize(
    "args, env, culprit",
    [
        (["0", "2", "true"], {}, "'0'"),
        (["2", "-1", "true"], {}, "'-1'"),
        (["two", "2", "true"], {}, "'two'"),
        (["2", "1.5", "true"], {}, "'1.5'"),
        (["2", "2"], {}, "got 2 argument(s)"),
        (["--bogus", "2", "2", "true"], {}, "'--bogus'"),
        (["2", "2", "true"], {"JAXRL_PORT": "99999"}, "'99999'"),
    ],
)
def test_local_bad_arguments_exit_2(args, env, culprit):
    proc = run([LOCAL, "--dry-run", *args], env=clean_env(**env))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and culprit in proc.stderr


@pytest.mark.parametrize("script", [LOCAL, TPU, SLURM])
def test_help(script):
    proc = run(["bash", script, "--help"])
    assert proc.returncode == 0 and proc.stdout.startswith("Usage:")


_CHILD = textwrap.dedent(
    """
    import json
    import numpy as np
    from jaxrl_llm import distributed

    assert distributed.initialize() is True
    assert distributed.initialize() is True  # idempotent
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    pid = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    # Process p holds rows [10p + 1, 10p + 2]; only a real cross-process reduction sees all 4.
    local = np.array([10 * pid + 1, 10 * pid + 2], np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    print("RESULT " + json.dumps({
        "process_index": pid,
        "main": distributed.is_main_process(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "global_shape": list(x.shape),
        "sum": float(total),
        "collectives": jax.config.jax_cpu_collectives_implementation,
    }), flush=True)
    """
)


def test_two_processes_sum_across_processes():
    proc = run([LOCAL, "2", "2", sys.executable, "-c", _CHILD], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert json.loads(line.removeprefix("RESULT ")) == {
        "process_index": 0,
        "main": True,
        "process_count": 2,
        "device_count": 4,
        "local_device_count": 2,
        "global_shape": [4],
        "sum": 1 + 2 + 11 + 12,
        "collectives": "gloo",
    }
    # Process 1 ran too; its output arrives on stderr, prefixed.
    assert re.search(r'^\[p1\] RESULT .*"process_index": 1, .*"sum": 26\.0', proc.stderr, re.M)


_FAIL = textwrap.dedent(
    """
    import os, signal, sys, time
    if os.environ["JAX_PROCESS_ID"] == "1":
        sys.exit(3)
    # Like a JAX process, whose preemption notifier catches SIGTERM: only SIGKILL stops it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)
    """
)


def test_failing_process_stops_the_others():
    start = time.monotonic()
    env = clean_env(JAXRL_KILL_GRACE="1")
    proc = run([LOCAL, "3", "1", sys.executable, "-c", _FAIL], env=env, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "process 1 exited with status 3" in proc.stderr
    assert time.monotonic() - start < 30


_TRAP = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    out = pathlib.Path(sys.argv[1]) / os.environ["JAX_PROCESS_ID"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        out.with_suffix(".ready").touch()
        time.sleep(60)
    except SystemExit:
        out.with_suffix(".TERM").touch()
        raise
    except KeyboardInterrupt:
        out.with_suffix(".INT").touch()
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_signals_reach_every_process(tmp_path, sig):
    launcher = subprocess.Popen(
        [LOCAL, "2", "1", sys.executable, "-c", _TRAP, str(tmp_path)],
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell started in the background may ignore SIGINT, and then so would we.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("*.ready"))) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err
    assert sorted(p.name for p in tmp_path.glob(f"*.{sig.name[3:]}")) == [
        f"0.{sig.name[3:]}",
        f"1.{sig.name[3:]}",
    ]


# --- tpu_vm.sh --------------------------------------------------------------------------------


def test_tpu_dry_run_prints_gcloud_ssh_to_all_workers():
    cmd = [TPU, "--dry-run", "--tpu", "v4-32", "--zone", "us-central2-b", "--project", "p1"]
    proc = run([*cmd, "--workdir", "/srv/my repo", "--", "python3", "-m", "jaxrl_llm.train"])
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    words = shlex.split(line)
    assert words[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "v4-32"]
    assert words[6:11] == ["--zone", "us-central2-b", "--project", "p1", "--worker=all"]
    assert words[11] == "--command"
    remote = shlex.split(words[12])
    assert remote == [
        *("export", "JAXRL_DISTRIBUTED=auto;", "cd", "/srv/my repo"),
        *("&&", "python3", "-m", "jaxrl_llm.train"),
    ]


def test_tpu_dry_run_defaults_workdir_to_this_checkout():
    proc = run([TPU, "--dry-run", "--tpu", "t", "--zone", "z", "--", "make", "train"])
    assert proc.returncode == 0, proc.stderr
    command = shlex.split(proc.stdout)[-1]
    assert command == f"export JAXRL_DISTRIBUTED=auto; cd {ROOT} && make train"


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["--zone", "z", "--", "true"], "--tpu"),
        (["--tpu", "t", "--", "true"], "--zone"),
        (["--tpu", "t", "--zone", "z"], "COMMAND"),
        (["--tpu", "t", "--zone"], "--zone needs a value"),
        (["--tpu", "t", "--zone", "z", "true"], "'true'"),
    ],
)
def test_tpu_bad_arguments_exit_2(args, culprit):
    proc = run([TPU, "--dry-run", *args])
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and culprit in proc.stderr


# --- gpu_slurm.sbatch ------------------------------------------------------------------------


def test_slurm_dry_run_prints_srun_and_coordinator():
    env = clean_env(SLURM_JOB_ID="123456", SLURM_JOB_NODELIST="gpu[003-005,9],login1")
    env["SLURM_NTASKS"] = "4"
    proc = run(["bash", SLURM, "--dry-run", "python", "-m", "jaxrl_llm.train", "--x", "a b"], env)
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    # The port JAX's SLURM detection derives from the job id: 123456 % 4096 + 61440.
    assert shlex.split(line) == [
        *("env", "JAX_COORDINATOR_ADDRESS=gpu003:62016", "srun", "--kill-on-bad-exit=1"),
        *("python", "-m", "jaxrl_llm.train", "--x", "a b"),
    ]


def test_slurm_dry_run_one_gpu_per_task():
    env = clean_env(SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n1,n2", SLURM_NTASKS="16")
    env.update(SLURM_GPUS_PER_TASK="1", JAX_COORDINATOR_PORT="5000")
    proc = run(["bash", SLURM, "--dry-run", "train"], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [
        *("env", "JAX_COORDINATOR_ADDRESS=n1:5000", "JAX_LOCAL_DEVICE_IDS=0"),
        *("srun", "--kill-on-bad-exit=1", "train"),
    ]


@pytest.mark.parametrize(
    "env, args, culprit",
    [
        ({}, ["train"], "SLURM_JOB_ID"),
        ({"SLURM_JOB_ID": "1"}, ["train"], "SLURM_JOB_NODELIST"),
        ({"SLURM_JOB_ID": "x1", "SLURM_JOB_NODELIST": "n1"}, ["train"], "'x1'"),
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1"}, [], "COMMAND"),
    ],
)
def test_slurm_bad_arguments_exit_2(env, args, culprit):
    proc = run(["bash", SLURM, "--dry-run", *args], clean_env(**env))
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and culprit in proc.stderr


# --- jaxrl_llm.distributed ------------------------------------------------------------------


def test_initialize_without_settings_is_single_process():
    code = (
        "import jax; from jaxrl_llm import distributed;"
        "print(distributed.initialize(), jax.distributed.is_initialized(), jax.process_count())"
    )
    proc = run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "1"]


def test_initialize_after_jax_started_is_an_error():
    code = (
        "import jax; from jaxrl_llm import distributed; jax.devices();"
        "distributed.initialize('127.0.0.1:1', num_processes=2, process_id=0)"
    )
    proc = run([sys.executable, "-c", code])
    assert proc.returncode == 1
    assert "RuntimeError: jaxrl_llm.distributed.initialize() must run before" in proc.stderr


@pytest.mark.parametrize(
    "kwargs, env, message",
    [
        ({"num_processes": 2}, {}, "coordinator (JAX_COORDINATOR_ADDRESS) is unset"),
        ({"coordinator": "h:1", "num_processes": 2}, {}, "process_id (JAX_PROCESS_ID) is unset"),
        ({"coordinator": "h:1"}, {}, "num_processes (JAX_NUM_PROCESSES) is unset"),
        ({}, {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, "coordinator (JAX_COORD"),
        ({"process_id": 0}, {"JAX_COORDINATOR_ADDRESS": "h:1"}, "num_processes (JAX_NUM_PRO"),
        ({"num_processes": 2, "process_id": 2}, {}, "process_id must be < num_processes=2, got 2"),
        ({"num_processes": 0}, {}, "num_processes must be >= 1, got 0"),
        ({"process_id": -1}, {}, "process_id must be >= 0, got -1"),
        ({}, {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES must be an integer, got 'two'"),
        ({"num_processes": 2}, {"JAXRL_DISTRIBUTED": "yes"}, "got 'yes'"),
    ],
)
def test_initialize_rejects_incomplete_settings(no_cluster, kwargs, env, message):
    for key, value in env.items():
        no_cluster.setenv(key, value)
    # Raised before anything reaches JAX, so this process's JAX state is untouched.
    with pytest.raises(ValueError, match=re.escape(message)):
        distributed.initialize(**kwargs)


def test_initialize_arguments_override_environment(no_cluster):
    no_cluster.setenv("JAX_NUM_PROCESSES", "4")
    no_cluster.setenv("JAX_PROCESS_ID", "3")
    # One process by explicit choice: nothing to start, whatever the environment says.
    assert distributed.initialize("h:1", num_processes=1, process_id=0) is False


_SLURM_STEP = {
    "SLURM_JOB_ID": "5",
    "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),
        (_SLURM_STEP, "slurm"),
        ({**_SLURM_STEP, "SLURM_NTASKS": "1"}, None),  # a single task is a plain run
        ({k: v for k, v in _SLURM_STEP.items() if k != "SLURM_LOCALID"}, None),  # JAX needs it
        ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://h:1", "OMPI_COMM_WORLD_SIZE": "4"}, "ompi"),
        ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://h:1", "OMPI_COMM_WORLD_SIZE": "1"}, None),
        ({"TPU_WORKER_HOSTNAMES": "w0,w1"}, None),  # not a Cloud TPU VM, so JAX ignores it
        ({"JAXRL_DISTRIBUTED": "auto"}, "auto"),
    ],
)
def test_detect_cluster(no_cluster, env, expected):
    for key, value in env.items():
        no_cluster.setenv(key, value)
    assert distributed.detect_cluster() == expected


def test_detected_cluster_fills_in_missing_settings(no_cluster):
    # Inside a SLURM step JAX supplies what is unset, so a lone coordinator is not an error:
    # initialize() goes on to start JAX (stopped here, before it can).
    for key, value in _SLURM_STEP.items():
        no_cluster.setenv(key, value)
    no_cluster.setenv("JAX_COORDINATOR_ADDRESS", "n1:1234")
    calls = []
    no_cluster.setattr(distributed, "_backend_started", lambda: False)
    no_cluster.setattr(distributed.jax.distributed, "initialize", lambda **kw: calls.append(kw))
    assert distributed.initialize() is True
    assert calls == [{"coordinator_address": "n1:1234", "num_processes": None, "process_id": None}]
