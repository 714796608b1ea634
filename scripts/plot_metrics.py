"""Plots metrics curves from one or more workdirs' metrics.jsonl to a PNG.

    python scripts/plot_metrics.py WORKDIR [WORKDIR ...] [--out curve.png]
        [--keys eval/accuracy 'reward/*/mean' ...]

One panel per key (shell-style patterns allowed), one line per workdir, x = step.
Needs matplotlib (the `plot` extra); it draws with the Agg backend, so no display is used.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import math
import os
import sys

from jaxrl_llm.metrics import by_step, read_metrics

DEFAULT_KEYS = ("eval/accuracy", "reward/correct/mean")


def select_keys(records: list[dict], patterns) -> list[str]:
    """Metric names matching the patterns, in pattern order, then in first-seen order."""
    names = list(dict.fromkeys(k for r in records for k in r if k != "step"))
    matched = [n for p in patterns for n in names if fnmatch.fnmatchcase(n, p)]
    return list(dict.fromkeys(matched))


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over step-merged records; steps without it or NaN skipped."""
    steps, values = [], []
    for r in by_step(records):
        v = r.get(key)
        if isinstance(v, int | float) and not math.isnan(v):
            steps.append(r["step"])
            values.append(float(v))
    return steps, values


def plot(runs: dict[str, list[dict]], keys: list[str], out: str) -> None:
    """Draws one panel per key with one line per run and saves a PNG to `out`."""
    import matplotlib

    matplotlib.use("Agg")  # headless: CI and servers have no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        for name, records in runs.items():
            steps, values = series(records, key)
            if steps:
                ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=name)
        ax.set_ylabel(key)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workdirs", nargs="+", help="run directories (or metrics.jsonl files)")
    parser.add_argument("--out", default=None, help="PNG path (default: WORKDIR/metrics.png)")
    parser.add_argument(
        "--keys",
        nargs="+",
        default=None,
        help=f"metric names or patterns (default: {DEFAULT_KEYS})",
    )
    args = parser.parse_args(argv)

    runs = {}
    for w in args.workdirs:
        name = os.path.basename(os.path.normpath(w if os.path.isdir(w) else os.path.dirname(w)))
        runs[w if not name or name in runs else name] = read_metrics(w)
    all_records = [r for records in runs.values() for r in records]
    keys = select_keys(all_records, args.keys or DEFAULT_KEYS)
    if not keys:
        available = ", ".join(select_keys(all_records, ["*"])) or "none"
        parser.error(f"no metric matches {args.keys or list(DEFAULT_KEYS)}; available: {available}")
    first = args.workdirs[0]
    out = args.out or os.path.join(first if os.path.isdir(first) else ".", "metrics.png")
    if importlib.util.find_spec("matplotlib") is None:
        print("plot_metrics: needs matplotlib: pip install -e '.[plot]'", file=sys.stderr)
        return 1
    plot(runs, keys, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
