"""Multi-process (multi-host) start-up: when and how to call `jax.distributed.initialize`.

Every process of a multi-host run executes the same program; before touching JAX it calls

    from jaxrl_llm import distributed
    distributed.initialize()          # or initialize(coordinator, num_processes, process_id)
    ...
    if distributed.is_main_process():
        print(metrics)                # log / write once, not once per host

`initialize` decides whether this is a multi-process run and only then starts JAX's own
distributed runtime (`jax.distributed`); there is no cluster layer of our own. Where the
settings come from, first match wins per setting:

1. its arguments (the trainer's CLI flags),
2. the environment `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`
   (what `launch/local_multihost.sh` sets),
3. JAX's cluster auto-detection: SLURM job steps with more than one task, Open MPI jobs with
   more than one rank, Cloud TPU VMs whose environment names several workers or slices, or any
   run with `JAXRL_DISTRIBUTED=auto` (what `launch/tpu_vm.sh` sets, because a GCE TPU VM keeps
   its worker list in the metadata server, not the environment). We only mirror the condition
   under which JAX detects a cluster; the coordinator, process count and id come from JAX.

A plain single-process run (nothing set, no cluster) is left alone: `initialize` returns False
and JAX starts lazily as usual. On CPU the cross-process collectives use gloo, JAX's default
`jax_cpu_collectives_implementation`.
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
# Opt-in for clusters JAX can detect but whose environment does not reveal how many hosts
# there are (GCE TPU VM slices): call `jax.distributed.initialize()` and let JAX decide.
ENV_MODE = "JAXRL_DISTRIBUTED"


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _env_count(name: str) -> int:
    """A process-count variable of a cluster, 1 when unset or unreadable (then JAX decides)."""
    try:
        return int(os.environ.get(name, "1"))
    except ValueError:
        return 1


def _on_cloud_tpu_vm() -> bool:
    # JAX sets this at import when libtpu and TPU chips are present; its TPU cluster
    # detection requires it, so ours does too. Private, hence the defensive lookup.
    try:
        from jax._src import cloud_tpu_init
    except ImportError:
        return False
    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


def detect_cluster() -> str | None:
    """Name of the multi-process cluster JAX would auto-detect here, or None.

    Mirrors the `is_env_present` conditions of `jax/_src/clusters/*.py`, narrowed to runs with
    more than one process: "auto" (`JAXRL_DISTRIBUTED=auto`), "slurm", "ompi" or "tpu".
    """
    mode = os.environ.get(ENV_MODE, "").strip().lower()
    if mode == "auto":
        return "auto"
    if mode:
        raise ValueError(f"{ENV_MODE} must be 'auto' or unset, got {mode!r}")
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
    if all(v in os.environ for v in (*slurm, "SLURM_LOCALID")):
        if _env_count("SLURM_NTASKS") > 1:
            return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in os.environ and _env_count("OMPI_COMM_WORLD_SIZE") > 1:
        return "ompi"
    if _on_cloud_tpu_vm():
        workers = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get("TPU_WORKER_HOSTNAMES")
        if workers and "," in workers:
            return "tpu"
        if (
            os.environ.get("MEGASCALE_COORDINATOR_ADDRESS")
            or _env_count("MEGASCALE_NUM_SLICES") > 1
        ):
            return "tpu"
    return None


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # jax.distributed.initialize will then raise its own error
        return False
    return xla_bridge.backends_are_initialized()


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Starts JAX's distributed runtime when this is a multi-process run; True if it runs.

    Call it first thing in `main`, before any JAX computation (even `jax.devices()`):

        initialize()                                   # environment / cluster decides
        initialize("10.0.0.1:1234", num_processes=2, process_id=0)   # explicit, e.g. CLI flags

    Each argument overrides its environment variable (`JAX_COORDINATOR_ADDRESS`,
    `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`). Without a detected cluster all three are needed
    once any is given; inside one (SLURM, TPU slice, ...) JAX fills in the ones left unset.
    `num_processes == 1` is a single-process run. Calling it again after it started the
    runtime is a no-op returning True.

    Raises:
      ValueError: incomplete or inconsistent settings (the message names the culprit).
      RuntimeError: a multi-process run, but a JAX backend has already been initialized.
    """
    if jax.distributed.is_initialized():
        return True
    if coordinator is None:
        coordinator = os.environ.get(ENV_COORDINATOR, "").strip() or None
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)

    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if process_id is not None and process_id < 0:
        raise ValueError(f"process_id must be >= 0, got {process_id}")
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ValueError(f"process_id must be < num_processes={num_processes}, got {process_id}")
    if num_processes == 1:
        return False

    cluster = detect_cluster()
    settings = {
        f"coordinator ({ENV_COORDINATOR})": coordinator,
        f"num_processes ({ENV_NUM_PROCESSES})": num_processes,
        f"process_id ({ENV_PROCESS_ID})": process_id,
    }
    if cluster is None:
        missing = [name for name, value in settings.items() if value is None]
        if len(missing) == len(settings):
            return False  # plain single-process run
        if missing:
            given = ", ".join(f"{n.split()[0]}={v!r}" for n, v in settings.items() if v is not None)
            raise ValueError(f"multi-process settings incomplete: {missing[0]} is unset ({given})")

    if _backend_started():
        raise RuntimeError(
            "jaxrl_llm.distributed.initialize() must run before any JAX computation, "
            "but a JAX backend is already initialized"
        )
    log.info(
        "jax.distributed.initialize(coordinator=%s, num_processes=%s, process_id=%s) [%s]",
        coordinator,
        num_processes,
        process_id,
        cluster or "explicit",
    )
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )
    return True


def is_main_process() -> bool:
    """True on process 0, the one that logs, evaluates and writes single-writer files."""
    return jax.process_index() == 0
