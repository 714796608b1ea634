"""Training metrics: JSONL + TensorBoard writer, a terminal progress line, masked
summaries for use inside jit, and per-stage wall-clock timers.

The JSONL file is the source of truth (one object per `write`, `{"step": s, ...}`), read
back by `read_metrics` and plotted by `scripts/plot_metrics.py`; TensorBoard events are a
convenience view of the same numbers.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm._checks import check_array

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"


# ----------------------------------------------------------------------------- writer


class MetricsWriter:
    """Appends `{"step": step, **metrics}` lines to `workdir/metrics.jsonl` and TB scalars.

    Values may be Python numbers, numpy scalars or 0-d numpy/jax arrays; all of one call's
    values are fetched from the device in a single transfer. Integers stay integers, bools
    become 0/1, everything else is a Python float.

    Non-finite values: JSON has no NaN or Infinity, so NaN and ±inf are written as `null`
    (every line stays valid JSON for `jq`, pandas or a browser); `read_metrics` turns `null`
    back into NaN. TensorBoard receives the true value.

    Only process 0 writes in a multi-process run; on the others every method is a no-op.
    Each line is flushed as it is written, so a crashed run keeps its metrics. The file is
    appended to, so a resumed run rewrites the steps after its checkpoint; `by_step`
    resolves those repeats in favour of the newest line.
    """

    def __init__(self, workdir: str | os.PathLike, *, tensorboard: bool = True):
        self.workdir = os.fspath(workdir)
        self.path = os.path.join(self.workdir, METRICS_FILE)
        self._active = jax.process_index() == 0
        self._file: TextIO | None = None
        self._tb = None
        if not self._active:
            return
        os.makedirs(self.workdir, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # closed by close()
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=os.path.join(self.workdir, TB_DIR))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes one record for `step`.

        Raises:
          ValueError: a value is not a scalar, or a key is "step".
        """
        if not self._active:
            return
        if "step" in metrics:
            raise ValueError('metrics: "step" is reserved; pass it as the `step` argument')
        host = jax.device_get(dict(metrics))  # one device->host transfer for all values
        values = {name: _to_python(name, v) for name, v in host.items()}
        step = int(step)
        record = {"step": step}
        record.update({k: _json_value(v) for k, v in values.items()})
        assert self._file is not None
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for name, v in values.items():
                self._tb.add_scalar(name, v, step)
            self._tb.flush()

    def close(self) -> None:
        """Flushes and closes the files (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._active = False

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _to_python(name: str, v) -> int | float:
    a = np.asarray(v)
    if a.ndim != 0:
        raise ValueError(f"metrics[{name!r}]: expected a scalar, got shape {a.shape}")
    if a.dtype == np.bool_:
        return int(a)
    if np.issubdtype(a.dtype, np.integer):
        return int(a)
    if np.issubdtype(a.dtype, np.floating):
        return float(a)
    raise ValueError(f"metrics[{name!r}]: expected a number, got {a.dtype}")


def _json_value(v: int | float) -> int | float | None:
    return v if isinstance(v, int) or math.isfinite(v) else None


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Reads a metrics JSONL file (or a workdir containing one) into a list of dicts.

    `null` values become NaN. A truncated last line (a crash mid-write) is skipped; a
    malformed line elsewhere raises ValueError naming the line number.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # no trailing newline: the write was cut short
                break
            raise ValueError(f"{path}:{i + 1}: not valid JSON: {e}") from e
        records.append({k: (math.nan if v is None else v) for k, v in record.items()})
    return records


def by_step(records: list[dict]) -> list[dict]:
    """Merges records with the same step (later values win), sorted by step.

    Train and eval metrics for one step come from separate `write` calls, and a resumed
    run re-logs the steps after its checkpoint; this gives one record per step.
    """
    merged: dict[int, dict] = {}
    for r in records:
        merged.setdefault(r["step"], {}).update(r)
    return [merged[s] for s in sorted(merged)]


# ----------------------------------------------------------------------------- progress


class Progress:
    """A one-line terminal progress report: step/total, the given fields, s/step and ETA.

    On a TTY the line is redrawn in place (`\\r`) at most every `tty_interval_s`; on
    anything else (CI logs, files) a plain line is printed every `every_steps` steps or
    `every_s` seconds, whichever comes first, and always at the last step.

    The ETA is (total - step) times an exponential moving average of seconds per step.
    The interval before the first `update` is never measured: it holds compilation, which
    would inflate the estimate for many steps.

    Printing errors (a closed stream) disable the progress line instead of stopping
    training.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        every_steps: int | None = None,
        every_s: float = 30.0,
        tty_interval_s: float = 0.1,
        ema: float = 0.1,
    ):
        """Configures the line; nothing is printed before the first `update`.

        Args:
          total_steps: the step number at which the run ends.
          stream: where to write (default: sys.stderr at construction time).
          enabled: None -> only on process 0.
          every_steps: non-TTY print period in steps (default: total_steps // 20, >= 1).
          every_s: non-TTY print period in seconds.
          tty_interval_s: minimum seconds between in-place redraws on a TTY.
          ema: weight of the newest step time in the moving average.
        """
        self.total = int(total_steps)
        self.stream = sys.stderr if stream is None else stream
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        try:
            self.tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self.tty = False
        self.every_steps = every_steps or max(1, self.total // 20)
        self.every_s = every_s
        self.tty_interval_s = tty_interval_s
        self.ema = ema
        self._sec_per_step: float | None = None
        self._last: tuple[int, float] | None = None  # (step, time) of the previous update
        self._printed: tuple[int, float] | None = None  # (step, time) of the last print
        self._width = 0

    def update(self, step: int, **fields: Any) -> None:
        """Records that `step` is done; `fields` (name=number) are shown as `name value`."""
        if not self.enabled:
            return
        now = time.perf_counter()
        step = int(step)
        if self._last is not None and step > self._last[0]:
            dt = (now - self._last[1]) / (step - self._last[0])
            s = self._sec_per_step
            self._sec_per_step = dt if s is None else (1 - self.ema) * s + self.ema * dt
        self._last = (step, now)
        if not self._due(step, now):
            return
        self._printed = (step, now)
        line = self.format(step, fields)
        if self.tty:
            pad = " " * max(0, self._width - len(line))  # wipe a longer previous line
            self._width = len(line)
            self._emit("\r" + line + pad)
        else:
            self._emit(line + "\n")

    def format(self, step: int, fields: Mapping[str, Any]) -> str:
        """The progress line for `step` without printing it."""
        pct = 100.0 * step / self.total if self.total else 100.0
        parts = [f"step {step}/{self.total} ({pct:.0f}%)"]
        parts += [f"{k} {_fmt_number(v)}" for k, v in fields.items()]
        if self._sec_per_step is not None:
            parts.append(f"{self._sec_per_step:.3g} s/step")
            remaining = max(0, self.total - step) * self._sec_per_step
            parts.append(f"ETA {_fmt_duration(remaining)}")
        return " | ".join(parts)

    def close(self) -> None:
        """Ends the in-place line with a newline (idempotent)."""
        if self.enabled and self.tty and self._width:
            self._emit("\n")
        self._width = 0
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _due(self, step: int, now: float) -> bool:
        if self._printed is None or step >= self.total:
            return True
        last_step, last_time = self._printed
        if self.tty:
            return now - last_time >= self.tty_interval_s
        return step - last_step >= self.every_steps or now - last_time >= self.every_s

    def _emit(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False


def _fmt_number(v) -> str:
    try:
        x = float(np.asarray(jax.device_get(v)))
    except (TypeError, ValueError):
        return str(v)
    if x.is_integer() and abs(x) < 1e6:
        return str(int(x))
    return f"{x:.4g}"


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


# ----------------------------------------------------------------------------- summaries


def masked_mean(x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean of `x` over the entries where `mask` is set: sum(x * m) / max(sum(m), 1).

    Args:
      x: float/int[...] values.
      mask: bool[...] or float[...] weights of the same shape, or None (plain mean).

    Returns:
      float32[] — 0 when the mask is empty (the convention of `losses.aggregate`), so a
      batch with no valid entries logs 0 rather than NaN.
    """
    x = jnp.asarray(x, jnp.float32)
    if mask is None:
        return jnp.mean(x) if x.size else jnp.float32(0.0)
    check_array("mask", mask, shape=x.shape, kind="bool_or_float", layout="like x")
    w = jnp.asarray(mask, jnp.float32)
    total = jnp.sum(jnp.where(w != 0, x * w, 0.0))  # where: NaN in masked-out slots
    return total / jnp.maximum(jnp.sum(w), 1.0)


def summarize(prefix: str, x: jax.Array, mask: jax.Array | None = None) -> dict[str, jax.Array]:
    """`{prefix}/mean`, `/std`, `/min`, `/max` of `x` over the masked entries (jit-able).

    std is the population (ddof=0) weighted standard deviation,
    sqrt(masked_mean((x - mean)^2, mask)). Entries with mask 0 are ignored even if NaN.
    With an empty mask all four are 0.

    Args:
      prefix: the name prefix, e.g. "advantages" or "reward/correct".
      x: float/int[...] values, e.g. advantages [P, G] or lengths [P, G].
      mask: bool/float[...] of the same shape, or None (all entries).

    Returns:
      a dict of float32[] scalars.
    """
    x = jnp.asarray(x, jnp.float32)
    if mask is None:
        mask = jnp.ones(x.shape, bool)
    check_array("mask", mask, shape=x.shape, kind="bool_or_float", layout="like x")
    keep = jnp.asarray(mask) != 0
    any_kept = jnp.any(keep)
    mean = masked_mean(x, mask)
    std = jnp.sqrt(masked_mean(jnp.where(keep, x - mean, 0.0) ** 2, mask))
    lo = jnp.min(jnp.where(keep, x, jnp.inf), initial=jnp.inf)
    hi = jnp.max(jnp.where(keep, x, -jnp.inf), initial=-jnp.inf)
    return {
        f"{prefix}/mean": mean,
        f"{prefix}/std": std,
        f"{prefix}/min": jnp.where(any_kept, lo, 0.0),
        f"{prefix}/max": jnp.where(any_kept, hi, 0.0),
    }


# ----------------------------------------------------------------------------- timing


class _Stage:
    """Handle yielded by `StageTimer(...)`; `block(value)` marks the stage's output."""

    def __init__(self):
        self._outputs: list = []

    def block(self, value):
        """Registers `value` (any pytree) to be waited on when the stage ends; returns it."""
        self._outputs.append(value)
        return value


class StageTimer:
    """Wall-clock time of named stages, reported as `time/<name>_s`.

    JAX dispatches asynchronously: a jitted call returns before the device has finished,
    so timing the call alone measures dispatch, and the real cost shows up in whichever
    later stage first reads the result. Hand the stage's output to `block` and the timer
    calls `jax.block_until_ready` on it before stopping the clock::

        timer = StageTimer()
        with timer("sample") as stage:
            rollouts = stage.block(sample_fn(params, prompts))
        with timer("update") as stage:
            state, m = stage.block(train_step(state, batch))
        metrics.update(timer.results())  # {"time/sample_s": ..., "time/update_s": ...}

    Repeated stages within one report (e.g. DAPO refill rounds) add up. `results()`
    resets the totals unless `reset=False`. The stage is timed even if it raises.
    """

    def __init__(self):
        self._totals: dict[str, float] = collections.defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[_Stage]:
        stage = _Stage()
        start = time.perf_counter()
        try:
            yield stage
            if stage._outputs:
                jax.block_until_ready(stage._outputs)
        finally:
            self._totals[name] += time.perf_counter() - start

    def results(self, *, reset: bool = True) -> dict[str, float]:
        """`{"time/<name>_s": seconds}` for every stage since the last reset."""
        out = {f"time/{name}_s": t for name, t in self._totals.items()}
        if reset:
            self._totals.clear()
        return out
