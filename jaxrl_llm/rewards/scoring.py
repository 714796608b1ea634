"""Scoring N completions with K rewards into float32 [N, K], in this process or in workers.

A reward call that raises, returns something that is not a real number, returns NaN or
+-inf, or runs past ``timeout_s`` leaves its entry NaN -- the trainer treats that rollout as
invalid -- and is counted per reward (`ScoreResult.failures`); the first message of each
failing reward is logged once per call. The run goes on.

With ``num_workers > 0`` the rewards run in a pool of *spawned* processes (the parent runs
JAX, which is not fork-safe). Only plain data crosses the process boundary -- the rewards'
names and kwargs, then (text, length, answer, metadata) rows -- and every worker resolves
the rewards itself (`resolve.resolve_reward`), so user functions need not be picklable.

Time limits (``timeout_s`` per call of one reward on one completion; 0 = no limit):

* a SIGALRM timer (``setitimer``) interrupts the call with `RewardTimeout`, a BaseException
  so that ``except Exception`` in a reward does not swallow it. Signals work only in a
  process's main thread -- a worker's, or the caller's in-process -- and interrupt Python
  code (``time.sleep`` included), not one long C call (a huge ``int`` power, a regex);
* a call that returns late anyway (it swallowed the interruption, or ran in-process in
  another thread, where no timer can be armed -- and a thread cannot be killed) is counted
  as a timeout and its value dropped; in-process it is *not* stopped;
* with workers, a call still running ``2 * timeout_s + 1`` seconds after it started has its
  worker killed: the pool is recreated, the call counted as a timeout and the unfinished
  rows sent again. So only workers bound the time of every call for certain.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import logging
import math
import multiprocessing
import numbers
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple

import numpy as np

from jaxrl_llm.rewards.registry import RewardError, RewardFn
from jaxrl_llm.rewards.resolve import resolve_reward, reward_labels

log = logging.getLogger(__name__)

# Status of one (completion, reward) entry.
PENDING, OK, ERROR, NONFINITE, TIMEOUT, SKIPPED = -1, 0, 1, 2, 3, 4


class RewardTimeout(BaseException):
    """Raised inside a reward call when its ``timeout_s`` has passed (by SIGALRM)."""


class RewardFailures(NamedTuple):
    """Failed entries of one reward in one `score` call."""

    errors: int = 0  # raised, or returned something that is not a real number
    nonfinite: int = 0  # returned NaN or +-inf
    timeouts: int = 0  # ran past timeout_s (or its worker was killed)
    message: str = ""  # the first (lowest sample index) failure, one line


class ScoreResult(NamedTuple):
    """What `RewardPool.score` returns."""

    rewards: np.ndarray  # float32[N, K]; NaN where the reward failed (the rollout is invalid)
    labels: tuple[str, ...]  # [K] the rewards' labels (`resolve.reward_label`)
    failures: dict[str, RewardFailures]  # label -> counts, for each of the K rewards

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """Counts per reward: ``{prefix}/{label}/errors``, ``.../nonfinite``, ``.../timeouts``."""
        out = {}
        for label, f in self.failures.items():
            out[f"{prefix}/{label}/errors"] = float(f.errors)
            out[f"{prefix}/{label}/nonfinite"] = float(f.nonfinite)
            out[f"{prefix}/{label}/timeouts"] = float(f.timeouts)
        return out


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _preview(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _exception_line(e: BaseException) -> str:
    try:
        detail = str(e)
    except Exception:  # a broken __str__ must not break the error report
        detail = "<unprintable>"
    return _one_line(f"{type(e).__name__}: {detail}" if detail else type(e).__name__)


def _to_float(value: Any) -> float | None:
    """A reward's return value as a float, or None when it is not a real number.

    Accepted: Python and NumPy reals (bool included) and 0-d numeric arrays; not strings.
    """
    if isinstance(value, numbers.Real) or (
        getattr(value, "shape", None) == ()
        and getattr(getattr(value, "dtype", None), "kind", None) in ("b", "i", "u", "f")
    ):
        try:
            return float(value)
        except (OverflowError, TypeError, ValueError):  # e.g. an int beyond float range
            return None
    return None


# --------------------------------------------------------------------------- one call

_ARMED = [False]  # a SIGALRM now is the current call's timeout (not a stale signal)


def _on_alarm(signum, frame):
    del signum, frame
    if _ARMED[0]:
        _ARMED[0] = False
        raise RewardTimeout


def _alarm_usable() -> bool:
    """Whether this thread can arm a SIGALRM timer without disturbing someone else's."""
    return (
        threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    )


@contextlib.contextmanager
def _alarm_handler(enabled: bool):
    """Installs `_on_alarm` for SIGALRM for the duration, then restores the old handler."""
    if not enabled:
        yield
        return
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)


def _call(
    fn: RewardFn, row: tuple, timeout_s: float, use_alarm: bool
) -> tuple[int, Any, BaseException | None]:
    """Calls a reward on one ``(text, length, answer, metadata)`` row.

    Returns ``(status, value, exception)``: value is the float when OK, else a one-line
    description of the failure.
    """
    text, length, answer, metadata = row
    start = time.monotonic()
    try:
        try:
            if use_alarm:
                _ARMED[0] = True
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
            value = fn(text, length=length, answer=answer, metadata=metadata)
        finally:
            if use_alarm:
                _ARMED[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
    except RewardTimeout:  # also if it fired just as the call returned, inside `finally`
        return TIMEOUT, f"ran past timeout_s={timeout_s:g}", None
    except Exception as e:
        return ERROR, f"raised {_exception_line(e)}", e
    if timeout_s > 0 and time.monotonic() - start > timeout_s:
        return TIMEOUT, f"returned after {time.monotonic() - start:.3g} s > timeout_s", None
    x = _to_float(value)
    if x is None:
        return ERROR, f"returned {type(value).__name__} {_one_line(repr(value), 60)}", None
    if not math.isfinite(x):
        return NONFINITE, f"returned {x}", None
    return OK, x, None


# ---------------------------------------------------------------------- worker process

_WORKER: dict[str, Any] = {}


class _Slots(NamedTuple):
    """Shared memory through which the parent sees what each worker is running."""

    count: Any  # multiprocessing.Value("i"): slots taken so far
    pid: Any  # RawArray("q")[W]: the worker's pid once it is ready, else 0
    task: Any  # RawArray("q")[W]: the task it is running
    item: Any  # RawArray("q")[W]: the item (row * K + reward) within that task
    start: Any  # RawArray("d")[W]: time.monotonic() when that item started; 0 = idle


def _worker_init(specs: tuple, slots: _Slots, timeout_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent to handle
    # Rewards may use jax.numpy (`overlong`): on the host CPU only, never grabbing the
    # parent's accelerator. jax is imported (with this package) but no backend is up yet.
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    fns: list[Any] = []
    for name, kwargs in specs:
        try:
            fns.append(resolve_reward(name, **kwargs))
        except Exception as e:  # every call of it then reports this
            fns.append(f"could not be resolved in a worker: {_exception_line(e)}")
    if timeout_s > 0:
        signal.signal(signal.SIGALRM, _on_alarm)
    with slots.count.get_lock():
        slot = slots.count.value
        slots.count.value += 1
    _WORKER.update(fns=fns, slots=slots, slot=slot, timeout_s=timeout_s)
    if slot < len(slots.pid):
        slots.pid[slot] = os.getpid()


def _ping() -> int:
    return os.getpid()


def _score_rows(task_id: int, rows: list[tuple], skip: frozenset[int]) -> list[tuple[int, Any]]:
    """Runs every reward on every row, except the items in ``skip`` (row * K + reward)."""
    fns, slots, slot = _WORKER["fns"], _WORKER["slots"], _WORKER["slot"]
    timeout_s = _WORKER["timeout_s"]
    track = slot < len(slots.start)
    out: list[tuple[int, Any]] = []
    for j, row in enumerate(rows):
        for k, fn in enumerate(fns):
            item = j * len(fns) + k
            if item in skip:
                out.append((SKIPPED, None))
            elif isinstance(fn, str):
                out.append((ERROR, fn))
            else:
                if track:
                    slots.task[slot], slots.item[slot] = task_id, item
                    slots.start[slot] = time.monotonic()  # written last: marks the item live
                status, value, _ = _call(fn, row, timeout_s, timeout_s > 0)
                if track:
                    slots.start[slot] = 0.0
                out.append((status, value))
    return out


# -------------------------------------------------------------------------------- pool


class RewardPool:
    """Scores completions with K rewards, in this process or in worker processes.

    Create it once per run and reuse it: with workers, it starts ``num_workers`` spawned
    processes (each imports this package and resolves the rewards: seconds) and waits until
    they are ready. Use as a context manager, or call `close`.

    Args:
      rewards: K entries, each a reward name (`resolve.resolve_reward`: registry name,
        ``module:attr`` or ``file.py:attr``) or, in-process only, a reward function.
      reward_kwargs: hyperparameters per reward *label* (`resolve.reward_label`; for a
        registry name, the name itself), e.g. ``{"overlong": {"max_len": 64}}``. Plain data
        (sent to the workers).
      num_workers: 0 scores in the calling thread; > 0 in that many spawned processes.
      timeout_s: the limit per call of one reward on one completion; 0 = none. See the
        module docstring for what it can and cannot stop in-process.
      start_timeout_s: how long the workers may take to start.

    Raises:
      RewardSpecError: (a ValueError) a reward cannot be resolved -- checked here, up front.
      ValueError: bad arguments, or kwargs for a label that is not scored.
      TypeError: a function object with ``num_workers > 0``.
    """

    def __init__(
        self,
        rewards: Sequence[str | RewardFn],
        reward_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        num_workers: int = 0,
        timeout_s: float = 0.0,
        start_timeout_s: float = 300.0,
    ):
        if num_workers < 0:
            raise ValueError(f"num_workers: expected >= 0, got {num_workers}")
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s: expected >= 0 seconds, got {timeout_s}")
        rewards = tuple(rewards)
        if not rewards:
            raise ValueError("at least one reward is needed")
        self.labels = reward_labels(rewards)
        kwargs = {label: dict(kw) for label, kw in (reward_kwargs or {}).items()}
        named = [label for label, r in zip(self.labels, rewards) if isinstance(r, str)]
        unknown = set(kwargs) - set(named)
        if unknown:
            raise ValueError(
                f"reward_kwargs for rewards not being scored: {sorted(unknown)}; the keys "
                f"are reward labels: {named}"
            )
        objects = [label for label, r in zip(self.labels, rewards) if not isinstance(r, str)]
        if num_workers and objects:
            raise TypeError(
                f"rewards {objects} are function objects, which cannot be sent to worker "
                "processes; name them as 'module.path:function' or 'path/to/file.py:function'"
            )
        self.specs = tuple(
            (r, kwargs.get(label, {})) if isinstance(r, str) else None
            for label, r in zip(self.labels, rewards)
        )
        self.fns = tuple(
            resolve_reward(r, **kwargs.get(label, {})) if isinstance(r, str) else r
            for label, r in zip(self.labels, rewards)
        )
        self.num_workers, self.timeout_s = num_workers, float(timeout_s)
        self.start_timeout_s = start_timeout_s
        self.restarts = 0  # times the workers were killed and started again
        self._executor: cf.ProcessPoolExecutor | None = None
        self._slots: _Slots | None = None
        self._procs: list = []
        self._task_ids = itertools.count()
        if num_workers:
            self._start()

    # ---------------------------------------------------------------- worker lifecycle

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        w = self.num_workers
        slots = _Slots(
            ctx.Value("i", 0),
            ctx.RawArray("q", w),
            ctx.RawArray("q", w),
            ctx.RawArray("q", w),
            ctx.RawArray("d", w),
        )
        before = set(multiprocessing.active_children())
        self._executor = cf.ProcessPoolExecutor(
            w,
            mp_context=ctx,
            initializer=_worker_init,
            initargs=(self.specs, slots, self.timeout_s),
        )
        self._slots = slots
        # With spawn, each submit that finds no idle worker starts one, in this thread.
        pings = [self._executor.submit(_ping) for _ in range(w)]
        self._procs = [p for p in multiprocessing.active_children() if p not in before]
        deadline = time.monotonic() + self.start_timeout_s
        while not all(slots.pid[:]):
            failed = [f for f in pings if f.done() and f.exception() is not None]
            if failed:
                self._kill()
                raise RuntimeError(
                    f"reward worker processes failed to start: {failed[0].exception()!r}"
                )
            if time.monotonic() > deadline:
                self._kill()
                raise RuntimeError(
                    f"reward worker processes did not start within {self.start_timeout_s} s"
                )
            time.sleep(0.02)

    def _kill(self) -> None:
        """Kills the workers (one may be stuck) and drops the executor."""
        executor, procs = self._executor, self._procs
        self._executor, self._slots, self._procs = None, None, []
        if executor is None:
            return
        for p in procs:
            p.kill()
        executor.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.join(timeout=10)

    def close(self) -> None:
        """Stops the workers, if any; the pool starts them again if used after this."""
        if self._executor is None:
            return
        if any(self._slots.start[:]):  # a call is still running (an interrupted `score`)
            self._kill()
            return
        executor = self._executor
        self._executor, self._slots, self._procs = None, None, []
        executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ------------------------------------------------------------------------ scoring

    def score(
        self,
        completions_text: Sequence[str],
        completion_lengths: Sequence[int] | np.ndarray,
        answers: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
        *,
        strict: bool = False,
    ) -> ScoreResult:
        """Scores N completions with the K rewards: one column per reward, for GDPO.

        Args:
          completions_text: [N] decoded completions. For groups, flatten ``[P, G] -> [P*G]``
            prompt-major and reshape the result back with ``.reshape(P, G, K)``.
          completion_lengths: [N] completion lengths in tokens.
          answers: [N] reference answers.
          metadata: [N] per-sample task fields (``task``, ``numbers``, ``target``...), or None.
          strict: raise `RewardError` on the first error or timeout instead of scoring NaN.

        Returns:
          `ScoreResult` with float32 ``rewards`` [N, K] -- NaN where a call failed (errors,
          NaN/inf returned, timeouts), which the trainer counts as invalid rollouts -- and
          the failure counts per reward. Each failing reward logs one warning per call.
        """
        n = len(completions_text)
        if not len(completion_lengths) == len(answers) == n:
            raise ValueError(
                f"score: {n} completions, {len(completion_lengths)} lengths, {len(answers)} answers"
            )
        if metadata is None:
            metadata = [{}] * n
        elif len(metadata) != n:
            raise ValueError(f"score: {n} completions but {len(metadata)} metadata entries")
        rows = [
            (completions_text[i], int(completion_lengths[i]), answers[i], metadata[i])
            for i in range(n)
        ]
        k = len(self.fns)
        status = np.full((n, k), PENDING, np.int8)
        values = np.full((n, k), np.nan, np.float32)
        notes: dict[tuple[int, int], tuple[str, BaseException | None]] = {}
        if self.num_workers and n:
            self._score_in_workers(rows, status, values, notes)
        else:
            self._score_here(rows, status, values, notes, strict)
        if strict and np.isin(status, (ERROR, TIMEOUT)).any():
            i, j = min(ij for ij in notes if status[ij] in (ERROR, TIMEOUT))
            raise RewardError(self._message(j, i, rows, notes[i, j][0])) from notes[i, j][1]
        return self._result(rows, status, values, notes)

    def _message(self, k: int, i: int, rows: list[tuple], what: str) -> str:
        text, _, answer, _ = rows[i]
        return (
            f"reward {self.labels[k]!r} {what} on sample {i} (answer {answer!r}): {_preview(text)}"
        )

    def _result(self, rows, status, values, notes) -> ScoreResult:
        failures = {}
        for k, label in enumerate(self.labels):
            col = status[:, k]
            bad = np.flatnonzero(np.isin(col, (ERROR, NONFINITE, TIMEOUT)))
            first = (
                self._message(k, int(bad[0]), rows, notes[int(bad[0]), k][0]) if len(bad) else ""
            )
            f = RewardFailures(
                errors=int((col == ERROR).sum()),
                nonfinite=int((col == NONFINITE).sum()),
                timeouts=int((col == TIMEOUT).sum()),
                message=first,
            )
            failures[label] = f
            if f.errors or f.timeouts:
                log.warning(
                    "reward %r failed on %d of %d completions (%d errors, %d timeouts, %d "
                    "NaN/inf), scored NaN (invalid); first: %s",
                    label,
                    len(bad),
                    len(rows),
                    f.errors,
                    f.timeouts,
                    f.nonfinite,
                    first,
                )
        return ScoreResult(values, self.labels, failures)

    def _score_here(self, rows, status, values, notes, strict) -> None:
        use_alarm = self.timeout_s > 0 and _alarm_usable()
        with _alarm_handler(use_alarm):
            for i, row in enumerate(rows):
                for k, fn in enumerate(self.fns):
                    s, value, exc = _call(fn, row, self.timeout_s, use_alarm)
                    status[i, k] = s
                    if s == OK:
                        values[i, k] = value
                    else:
                        notes[i, k] = (value, exc)
                        if strict and s in (ERROR, TIMEOUT):
                            return

    def _running(self) -> list[tuple[int, int, float]]:
        """(task, item, started) of each item a worker is running now."""
        out, slots = [], self._slots
        for w in range(self.num_workers):
            started = slots.start[w]
            if started > 0:
                task, item = slots.task[w], slots.item[w]
                if slots.start[w] == started:  # not torn by the worker moving on
                    out.append((task, item, started))
        return out

    def _score_in_workers(self, rows, status, values, notes) -> None:
        try:
            self._run_workers(rows, status, values, notes)
        except BaseException:  # e.g. Ctrl-C: leave no worker busy with this call
            self._kill()
            raise

    def _run_workers(self, rows, status, values, notes) -> None:
        unexplained = 0  # pool breakdowns with no reward call running to blame
        while (status == PENDING).any():
            if self._executor is None:
                self._start()
            if not self._round(rows, status, values, notes):
                unexplained += 1
                if unexplained > 2:
                    raise RuntimeError("reward worker processes keep dying outside reward calls")

    def _round(self, rows, status, values, notes) -> bool:
        """Sends every row with a pending entry to the workers and records what comes back.

        Returns False if the pool broke and no running call could be blamed for it.
        """
        k = len(self.fns)
        todo = np.flatnonzero((status == PENDING).any(axis=1))
        chunk = max(1, min(16, math.ceil(len(todo) / (4 * self.num_workers))))
        tasks: dict[int, np.ndarray] = {}  # task id -> its rows
        pending: dict[cf.Future, int] = {}
        broken = False
        for start in range(0, len(todo), chunk):
            idx = todo[start : start + chunk]
            skip = frozenset(int(j * k + r) for j, r in np.argwhere(status[idx] != PENDING))
            tid = next(self._task_ids)
            tasks[tid] = idx
            try:
                future = self._executor.submit(_score_rows, tid, [rows[i] for i in idx], skip)
            except BrokenProcessPool:
                broken = True
                break
            pending[future] = tid

        def collect(futures) -> bool:
            lost = False
            for f in futures:
                idx = tasks[pending.pop(f)]
                try:
                    _record(f.result(), idx, k, status, values, notes)
                except BrokenProcessPool:
                    lost = True
                except Exception as e:  # e.g. a row that cannot be pickled
                    for i, r in np.argwhere(status[idx] == PENDING):
                        status[idx[i], r] = ERROR
                        notes[idx[i], r] = (f"could not be run: {_exception_line(e)}", e)
            return lost

        hard_limit = 2 * self.timeout_s + 1.0
        hung: list[tuple[int, int, float]] = []
        while pending and not broken and not hung:
            done, _ = cf.wait(
                pending,
                timeout=0.1 if self.timeout_s > 0 else None,
                return_when=cf.FIRST_COMPLETED,
            )
            broken = collect(done)
            if self.timeout_s > 0:
                now = time.monotonic()
                hung = [t for t in self._running() if now - t[2] > hard_limit]
        if not (broken or hung):
            return True
        running = self._running()
        self._kill()
        self.restarts += 1
        collect([f for f in pending if f.done()])  # what finished before the kill
        if hung:
            blamed, what, s = hung, "ran past timeout_s, and its worker was killed", TIMEOUT
        else:
            # A worker died (a crash, os._exit, the OOM killer). The calls running then are
            # all suspects, as the executor stops every worker when one dies.
            blamed, what, s = running, "was running when a worker process died", ERROR
        blamed = [(tid, item) for tid, item, _ in blamed if tid in tasks]
        for tid, item in blamed:
            i, r = tasks[tid][item // k], item % k
            if status[i, r] == PENDING:
                status[i, r] = s
                notes[i, r] = (what, None)
        return bool(blamed)


def _record(results, idx, k, status, values, notes) -> None:
    """Writes one task's results, row-major [len(idx) * K], into the [N, K] arrays."""
    for item, (s, value) in enumerate(results):
        if s == SKIPPED:
            continue
        i, r = idx[item // k], item % k
        status[i, r] = s
        if s == OK:
            values[i, r] = value
        else:
            notes[i, r] = (value, None)


def score_with_errors(
    rewards: RewardPool | Sequence[str | RewardFn],
    completions_text: Sequence[str],
    completion_lengths: Sequence[int] | np.ndarray,
    answers: Sequence[str],
    metadata: Sequence[Mapping[str, Any]] | None = None,
    *,
    reward_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    timeout_s: float = 0.0,
    strict: bool = False,
) -> ScoreResult:
    """`RewardPool.score` with a pool, or in-process with a temporary one built from names.

    ``rewards`` is a `RewardPool` (then ``reward_kwargs`` and ``timeout_s`` are the pool's)
    or K reward names / functions (see `RewardPool`).
    """
    if isinstance(rewards, RewardPool):
        if reward_kwargs or timeout_s:
            raise ValueError("score: a RewardPool carries its own reward_kwargs and timeout_s")
        return rewards.score(completions_text, completion_lengths, answers, metadata, strict=strict)
    with RewardPool(rewards, reward_kwargs, timeout_s=timeout_s) as pool:
        return pool.score(completions_text, completion_lengths, answers, metadata, strict=strict)


def score(
    rewards: RewardPool | Sequence[str | RewardFn],
    completions_text: Sequence[str],
    completion_lengths: Sequence[int] | np.ndarray,
    answers: Sequence[str],
    metadata: Sequence[Mapping[str, Any]] | None = None,
    *,
    reward_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    timeout_s: float = 0.0,
    strict: bool = False,
) -> np.ndarray:
    """float32 [N, K] rewards (`score_with_errors(...).rewards`); NaN where a call failed.

    Failures no longer stop the run: they are logged and scored NaN (an invalid rollout).
    ``strict=True`` raises `RewardError` on the first error or timeout instead.
    """
    return score_with_errors(
        rewards,
        completions_text,
        completion_lengths,
        answers,
        metadata,
        reward_kwargs=reward_kwargs,
        timeout_s=timeout_s,
        strict=strict,
    ).rewards
