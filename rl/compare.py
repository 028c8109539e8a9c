"""`python -m rl.compare`: RL runs side by side, from their metrics.jsonl files.

    python -m rl.compare mis_po=runs/rl_arith ppo=runs/ppo_arith grpo=runs/grpo_arith \\
        [--metric eval/accuracy/add ...] [--json FILE.json] [--plot FILE.png]

Prints a markdown table, one row per run: held-out exact match (greedy and sampled, at the
first and the last evaluation), training reward and KL to the initial policy (means of the
first and last ten logged iterations), response length, seconds per iteration and, for runs
with DAPO's dynamic sampling, the batches drawn per iteration and the reward over every group
drawn. Each `--metric NAME` (e.g. a per-task metric: `eval/accuracy/<task>`,
`distill/kl/<task>`, `response_length/<task>`) adds the column "NAME last": its last value
for an evaluation (`eval/...`), else the mean of the last ten logged iterations. `--plot`
draws held-out accuracy, training reward, KL, response length and each `--metric` against the
iteration, one line per run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from model.config.cli import ArgumentParser
from train.telemetry.metrics import METRICS_FILE, read_metrics

WINDOW = 10  # iterations averaged at the start and the end of a run

# (column, metric, which end of the run): "first"/"last" evaluation, or the mean of the first
# or last WINDOW logged iterations.
COLUMNS = (
    ("greedy before", "eval/accuracy", "first"),
    ("greedy after", "eval/accuracy", "last"),
    ("sampled before", "eval/sample_accuracy", "first"),
    ("sampled after", "eval/sample_accuracy", "last"),
    ("reward first 10", "reward", "first_window"),
    ("reward last 10", "reward", "last_window"),
    ("KL last 10", "kl", "last_window"),
    ("response length last 10", "response_length", "last_window"),
    ("s / iteration", "iteration_seconds", "mean"),
    ("draws / iteration", "sampling/draws", "mean"),
    # DAPO's `reward` is the kept groups'; the policy's own is over every group drawn.
    ("drawn reward last 10", "sampling/drawn_reward", "last_window"),
)
PANELS = (("held-out exact match, greedy", "eval/accuracy"),
          ("held-out exact match, sampled", "eval/sample_accuracy"),
          ("training reward", "reward"), ("KL to the initial policy", "kl"),
          ("response length (tokens)", "response_length"))


def series(records: list[dict], name: str) -> tuple[np.ndarray, np.ndarray]:
    """(iterations, values) of one metric, in the order logged; null values are NaN."""
    pairs = [(r["step"], math.nan if r[name] is None else float(r[name]))
             for r in records if name in r]
    if not pairs:
        return np.zeros(0, int), np.zeros(0)
    steps, values = zip(*pairs)
    return np.asarray(steps), np.asarray(values, np.float64)


def metric_columns(names: Sequence[str]) -> tuple:
    """The COLUMNS entries of `--metric` names: the last evaluation, or the last-ten mean."""
    return tuple((f"{name} last", name, "last" if name.startswith("eval/") else "last_window")
                 for name in names)


def summarize(records: list[dict], columns: tuple = COLUMNS) -> dict[str, float | None]:
    """Every `columns` entry of one run; None where the run logged no such metric, or only
    non-finite values where the column looks."""
    out: dict[str, float | None] = {}
    for column, name, where in columns:
        _, values = series(records, name)
        if not len(values):
            out[column] = None
            continue
        picked = {"first": values[:1], "last": values[-1:], "mean": values,
                  "first_window": values[:WINDOW], "last_window": values[-WINDOW:]}[where]
        finite = picked[np.isfinite(picked)]
        out[column] = float(finite.mean()) if len(finite) else None
    out["iterations"] = max((r["step"] for r in records), default=0)
    return out


def markdown_table(summaries: dict[str, dict], columns: tuple = COLUMNS) -> str:
    columns = [c for c, _, _ in columns if any(s[c] is not None for s in summaries.values())]
    lines = ["| run | iterations | " + " | ".join(columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for name, summary in summaries.items():
        cells = ["–" if summary[c] is None else f"{summary[c]:.3g}" for c in columns]
        lines.append(f"| {name} | {summary['iterations']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_runs(runs: dict[str, list[dict]], out: Path, panels: tuple = PANELS) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = min(len(panels), len(PANELS))
    height = -(-len(panels) // width)
    fig, axes = plt.subplots(height, width, figsize=(4.2 * width, 3.3 * height), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, name) in zip(axes.flat, panels):
        for run, records in runs.items():
            steps, values = series(records, name)
            marker = "o" if name.startswith("eval/") else None
            ax.plot(steps, values, linewidth=1, marker=marker, markersize=3, label=run)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("iteration", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)


def _run_argument(text: str) -> tuple[str, Path]:
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    return name, Path(directory)


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m rl.compare", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=_run_argument, metavar="NAME=DIR",
                        help=f"an RL workdir (holding {METRICS_FILE}) and its label")
    parser.add_argument("--metric", action="append", default=[], metavar="NAME",
                        help="add a column (and a plot panel) for this metric, e.g. "
                             "eval/accuracy/add; repeatable")
    parser.add_argument("--json", metavar="FILE.json", help="also write the table as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the runs' curves")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {}
    for name, directory in args.runs:
        if name in runs:
            parser.error(f"run name {name!r} given twice")
        path = directory / METRICS_FILE
        if not path.is_file():
            parser.error(f"{name}: no {METRICS_FILE} in {directory}")
        try:
            runs[name] = read_metrics(path)
        except (OSError, UnicodeDecodeError) as err:
            parser.error(f"{name}: cannot read {path}: {err}")
        if not runs[name]:
            parser.error(f"{name}: {path} holds no metrics records")
    columns = COLUMNS + metric_columns(args.metric)
    summaries = {name: summarize(records, columns) for name, records in runs.items()}
    print(markdown_table(summaries, columns))
    try:
        if args.json:
            Path(args.json).write_text(json.dumps(summaries, indent=1) + "\n")
        if args.plot:
            plot_runs(runs, Path(args.plot), PANELS + tuple((m, m) for m in args.metric))
    except (OSError, ValueError) as err:
        parser.error(f"cannot write the output: {getattr(err, 'strerror', None) or err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
