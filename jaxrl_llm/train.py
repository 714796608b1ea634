"""CLI: python -m jaxrl_llm.train --config quickstart [--config.a.b=v] [--workdir D].

`--config` takes a config file (`configs/quickstart.py`) or the name of one shipped with
the package (`quickstart`, `grpo`, ... : `jaxrl_llm.configs.NAMES`), which works from any
directory once the package is installed.

Multi-process runs (a TPU slice, a GPU cluster, `launch/local_multihost.sh`) start JAX's
distributed runtime first, from --coordinator/--num_processes/--process_id, the
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID environment, or JAX's own
cluster detection (`jaxrl_llm.distributed`). A configuration error is printed as one line,
`error: config.<key>: ...`, with exit status 2; SIGTERM / SIGINT end the run after the
current step with a checkpoint and exit status 0 (rerun the command to resume).
"""

from __future__ import annotations

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jaxrl_llm import configs, distributed

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    f"Experiment config: a file, or a built-in name ({', '.join(configs.NAMES)}).",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/quickstart", "Metrics and checkpoints go here.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "host:port of process 0 for a multi-process run (jax.distributed)."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0-based.")
flags.mark_flags_as_required(["config"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file operation at INFO
    try:
        distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from jaxrl_llm import trainer  # after the distributed runtime: it creates JAX arrays

    try:
        final = trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except ValueError as e:
        message = str(e)
        if not message.startswith(("config.", "loss.", "generate:", "ModelConfig.")):
            raise
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    if distributed.is_main_process():
        keep = ("eval/accuracy", "eval/pass@", "reward/total/mean", "time/step_s")
        print(json.dumps({k: v for k, v in final.items() if k.startswith(keep)}, sort_keys=True))


def run() -> None:
    """`app.run(main)`, with an unknown built-in config name or override key
    (`--config.rl.grop_size=4`, raised by ml_collections while absl parses the flags)
    reported as one line and exit status 2."""
    try:
        argv = configs.resolve_config_argv(sys.argv)
    except ValueError as e:
        print(f"error: --config: {e} (or give a config file's path)", file=sys.stderr)
        sys.exit(2)
    try:
        app.run(main, argv=argv)
    except (AttributeError, KeyError) as e:
        tb = e.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        if "ml_collections" not in tb.tb_frame.f_code.co_filename:
            raise
        message = str(e.args[0] if e.args else e).replace("\\'", "'").replace("\\n", " ")
        message = " ".join(message.replace("'", "").split())
        print(f"error: config override: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run()
