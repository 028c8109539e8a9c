"""Plots a run's metrics.jsonl: losses, learning rate, gradient norm, throughput and the MoE
stability monitors (report 4.1.2-4.1.3, 5.2.1) against the step, as one PNG; for an RL run
(`python -m rl`) reward, held-out accuracy, MIS-PO kept fractions, KL, entropy and gradient norms
against the iteration.

    python -m train.plot --workdir runs/tiny [--out FILE.png]

For a staged recipe's workdir (`python -m train --recipe`, DIR/stages/<kk>-<name>/) the stages
are drawn one after another on a common step axis, with a line at every stage boundary.
Panels without data in the file are left out; `null` values (non-finite) leave gaps.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Sequence

from model.config.cli import ArgumentParser
from train.telemetry.metrics import METRICS_FILE, read_metrics

# (title, metric names, log-scale y)
PANELS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("loss", ("loss", "loss/lm", "loss/mtp", "eval/loss"), False),
    ("balance losses (eq. 1; DeepSeek-V4 sequence-wise)",
     ("loss/balance", "loss/sequence_balance"), False),
    ("lightning-indexer KL (DeepSeek-V4 CSA)", ("loss/indexer",), True),
    ("learning rate", ("lr",), False),
    ("gradient norm", ("grad_norm",), True),
    ("update RMS", ("update_rms/muon", "update_rms/adamw"), False),
    ("tokens / s", ("tokens_per_sec",), False),
    ("MFU", ("mfu",), False),
    ("expert activation RMS / median (4.1.2)",
     ("moe/act_rms_max_over_median", "moe/act_rms_min_over_median"), True),
    ("expert output norm / median (4.1.3)",
     ("moe/out_norm_max_over_median", "moe/out_norm_min_over_median"), True),
    ("expert param norm / median (4.1.2)",
     ("moe/param_norm_max_over_median", "moe/param_norm_min_over_median"), False),
    ("expert load / mean", ("moe/load_max_over_mean", "moe/load_min_over_mean"), False),
    ("routing confidence Σk (5.2.1)", ("moe/routing_confidence", "routing_confidence"), False),
    # RL runs (python -m rl, report 5.2)
    ("reward and accuracy", ("reward", "eval/accuracy", "eval/sample_accuracy"), False),
    ("MIS-PO kept fraction (eq. 2)", ("token_keep_frac", "traj_keep_frac"), False),
    ("KL to the initial policy", ("kl",), False),
    ("entropy of sampled tokens", ("entropy",), False),
    ("RL gradient norms", ("actor/grad_norm", "critic/grad_norm"), True),
    ("critic loss", ("critic/loss",), True),
    ("truncation rate", ("truncation_rate",), False),
)
# One line per MoE layer: the report's Figure 4 view of where a blow-up starts.
PER_LAYER = (("act RMS max / median per layer", "act_rms_max_over_median"),
             ("output norm max / median per layer", "out_norm_max_over_median"))
_LAYER = re.compile(r"moe/layer(\d+)/(.+)")


def _series(records: list[dict], name: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in records:
        if name in record:
            value = record[name]
            steps.append(record["step"])
            values.append(math.nan if value is None else float(value))
    return steps, values


def _layer_names(records: list[dict], stat: str) -> list[str]:
    layers = {int(m.group(1)) for r in records for k in r
              if (m := _LAYER.fullmatch(k)) and m.group(2) == stat}
    return [f"moe/layer{i}/{stat}" for i in sorted(layers)]


def panels_with_data(records: list[dict]) -> list[tuple[str, list[str], bool]]:
    panels = [(title, [n for n in names if any(n in r for r in records)], log)
              for title, names, log in PANELS]
    panels += [(title, _layer_names(records, stat), True) for title, stat in PER_LAYER]
    return [p for p in panels if p[1]]


def stage_records(workdir: Path) -> tuple[list[dict], list[tuple[int, str]]]:
    """The metrics of a recipe workdir's stages, in order, with steps counted from the start of
    the first stage; and (first step, stage directory name) of every stage after the first."""
    records, boundaries, offset = [], [], 0
    for stage in sorted(p for p in (workdir / "stages").iterdir() if (p / METRICS_FILE).is_file()):
        stage_metrics = read_metrics(stage / METRICS_FILE)
        if not stage_metrics:
            continue
        if records:
            boundaries.append((offset, stage.name))
        records += [{**r, "step": r["step"] + offset} for r in stage_metrics]
        offset += stage_metrics[-1]["step"]
    return records, boundaries


def plot_metrics(records: list[dict], out: Path,
                 boundaries: Sequence[tuple[int, str]] = ()) -> int:
    """Draws the panels that have data into `out`, with a vertical line at each (step, label)
    of `boundaries`; returns the number of panels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = panels_with_data(records)
    if not panels:
        raise ValueError("no known metrics to plot")
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, names, log) in zip(axes.flat, panels):
        for name in names:
            layer = _LAYER.fullmatch(name)
            ax.plot(*_series(records, name), linewidth=1,
                    label=f"layer {layer.group(1)}" if layer else name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if log:
            ax.set_yscale("log")
        for step, label in boundaries:
            ax.axvline(step, color="grey", linestyle=":", linewidth=1)
            if ax is axes.flat[0]:
                ax.annotate(label, (step, 1), xycoords=("data", "axes fraction"), fontsize=7,
                            rotation=90, va="top", ha="right", color="grey")
        if 1 < len(names) <= 8:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return len(panels)


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m train.plot", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, metavar="DIR",
                        help=f"training run directory holding {METRICS_FILE}, or a recipe's")
    parser.add_argument("--out", metavar="FILE.png", help="output image (default DIR/metrics.png)")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    path, boundaries = workdir / METRICS_FILE, []
    try:
        if not path.is_file() and (workdir / "stages").is_dir():  # a staged recipe
            records, boundaries = stage_records(workdir)
            path = workdir / "stages"
        elif not path.is_file():
            parser.error(f"--workdir: no {METRICS_FILE} (or stages/ of a recipe) in {workdir}")
        else:
            records = read_metrics(path)
    except (OSError, UnicodeDecodeError) as err:
        parser.error(f"cannot read {path}: {err}")
    if not records:
        parser.error(f"{path} holds no metrics records")
    if not panels_with_data(records):
        parser.error(f"{path} holds none of the metrics this tool plots")
    out = Path(args.out) if args.out else Path(args.workdir) / "metrics.png"
    try:
        plot_metrics(records, out, boundaries)
    except (OSError, ValueError) as err:  # unwritable path, unknown image format
        parser.error(f"--out: cannot write {out}: {getattr(err, 'strerror', None) or err}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
