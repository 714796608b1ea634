"""CLI: python -m jaxrl_llm.train --config configs/quickstart.py [--config.a.b=v] [--workdir D]."""

from __future__ import annotations

import json

from absl import app, flags, logging
from ml_collections import config_flags

from jaxrl_llm import trainer

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/quickstart", "Metrics and checkpoints go here.")
flags.mark_flags_as_required(["config"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file operation at INFO
    final = trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    keep = ("eval/accuracy", "eval/pass@", "reward/total/mean", "time/step_s")
    print(json.dumps({k: v for k, v in final.items() if k.startswith(keep)}, sort_keys=True))


if __name__ == "__main__":
    app.run(main)
