"""A sweep's results: one row per run from its metrics.jsonl and config, written as
results.csv / results.md, and two plots (loss curves per run; held-out loss against training
FLOPs). Used by `python -m train.sweep` after every invocation.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Sequence

from model.config.cli import human
from model.flops import kv_cache_bytes
from model.summary import count_params
from train.experiments.sweep_file import Sweep, SweepRun
from train.telemetry.metrics import METRICS_FILE, read_metrics
from train.telemetry.mfu import train_flops_per_token

STATUS_FILE = "sweep_run.json"  # per run: wall-clock seconds spent training it, over invocations
# The KV cache is reported at one long context, not the runs' short training length: what
# sliding-window and compressed (CSA / HCA) layers save grows with the context.
KV_CONTEXT = 32768
COLUMNS = ("name", "status", "heldout_loss", "heldout_step", "train_loss", "steps", "tokens",
           "params_total", "params_active", "params_active_excl_embeddings",
           "train_flops_per_token", "train_flops", "kv_cache_bytes_32k", "tokens_per_sec",
           "train_seconds", "base", "overrides")


def _last(records: list[dict], key: str) -> tuple[int | None, float | None]:
    for record in reversed(records):
        if record.get(key) is not None:
            return record["step"], float(record[key])
    return None, None


def _run_row(sweep: Sweep, run: SweepRun, workdir: Path) -> dict | None:
    run_dir = workdir / "runs" / run.name
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        return None
    records = read_metrics(metrics)
    if not records:
        return None
    config = sweep.run_config(run)
    steps = records[-1]["step"]
    tokens = int(records[-1].get("tokens_seen") or 0)
    heldout_step, heldout = _last(records, "eval/loss")
    _, train_loss = _last(records, "loss/lm")
    rates = [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec")]
    counts = count_params(config.model)
    per_token = train_flops_per_token(config.model, config.train.seq_len,
                                      config.trained_mtp_heads())
    status_path = run_dir / STATUS_FILE
    seconds = json.loads(status_path.read_text())["train_seconds"] if status_path.is_file() else None
    return {
        "name": run.name,
        "status": "finished" if steps >= config.train.steps else f"partial ({steps}/{config.train.steps})",
        "heldout_loss": heldout, "heldout_step": heldout_step, "train_loss": train_loss,
        "steps": steps, "tokens": tokens,
        "params_total": counts["total"], "params_active": counts["active"],
        "params_active_excl_embeddings": counts["active_excl_embeddings"],
        "train_flops_per_token": per_token, "train_flops": per_token * tokens,
        "kv_cache_bytes_32k": kv_cache_bytes(config.model, KV_CONTEXT),
        "tokens_per_sec": statistics.median(rates) if rates else None,
        "train_seconds": seconds, "base": str(sweep.run_base(run)),
        "overrides": " ".join(run.overrides),
        **{name: _last(records, name)[1] for name in sweep.metrics},
        "curves": records,
    }


def collect_results(sweep: Sweep, workdir: Path) -> list[dict]:
    """One row per run of `sweep` that has metrics under `workdir`/runs, in sweep order. Each
    row has the COLUMNS, the sweep's extra `metrics` and `curves` (the run's metrics records)."""
    return [row for run in sweep.runs if (row := _run_row(sweep, run, workdir)) is not None]


def _fmt(value, spec: str = ".4f") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:{spec}}"
    return str(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s"


def write_csv(results: list[dict], path: Path, extra: Sequence[str] = ()) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS, *extra], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)


def markdown_table(results: list[dict], extra: Sequence[str] = ()) -> str:
    header = ("run", "held-out loss", "train loss (last)", "steps", "tokens", "params",
              "active params", "train FLOPs", "KV cache at 32k", "tokens/s", "wall time", *extra)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:  # extra metrics in significant digits: update RMS ~1e-4, load ratios ~1
        cells = (r["name"], _fmt(r["heldout_loss"]), _fmt(r["train_loss"]), str(r["steps"]),
                 human(r["tokens"]), human(r["params_total"]), human(r["params_active"]),
                 f"{r['train_flops']:.3g}", human(r["kv_cache_bytes_32k"], "B"),
                 _fmt(r["tokens_per_sec"], ".0f"),
                 _duration(r["train_seconds"]), *(_fmt(r[name], ".3g") for name in extra))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_markdown(results: list[dict], path: Path, sweep: Sweep) -> None:
    common = [*sweep.overrides, *sweep.command_line]
    own = " (runs with their own base: see Runs)" if any(r.base for r in sweep.runs) else ""
    parts = [f"# Sweep results\n\nBase config `{sweep.base}`{own}"
             + (f", overrides for every run: `{' '.join(common)}`" if common else "") + ".\n"]
    if sweep.description:
        parts.append(sweep.description.strip() + "\n")
    parts.append(markdown_table(results, sweep.metrics) + "\n")
    parts.append("Held-out loss: the last evaluation (`eval/loss`, nats per token); train loss: "
                 "the main head's loss at the last logged step; train FLOPs: model FLOPs of "
                 "forward + backward (`model.flops`, 3x forward) times tokens; KV cache at 32k: "
                 "`model.flops.kv_cache_bytes` after 32,768 tokens (batch 1, MTP blocks "
                 "included, compute dtype); tokens/s: median of the logged windows.\n")

    def run_line(r: dict) -> str:
        base = f" from `{r['base']}`" if r["base"] != str(sweep.base) else ""
        return f"- `{r['name']}` ({r['status']}){base}: `{r['overrides'] or '(base)'}`"

    parts.append("Runs:\n\n" + "\n".join(run_line(r) for r in results) + "\n")
    path.write_text("\n".join(parts))


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [float(v) for _, v in points]


def plot_loss_curves(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        line, = train_ax.plot(*_series(r["curves"], "loss/lm"), linewidth=1, label=r["name"])
        eval_ax.plot(*_series(r["curves"], "eval/loss"), marker="o", markersize=3,
                     color=line.get_color(), label=r["name"])
    for ax, title in ((train_ax, "training loss (main head)"), (eval_ax, "held-out loss")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def plot_quality_vs_flops(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [r for r in results if r["heldout_loss"] is not None and r["train_flops"] > 0]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for r in points:
        ax.scatter(r["train_flops"], r["heldout_loss"], s=30)
        ax.annotate(r["name"], (r["train_flops"], r["heldout_loss"]), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    if points and max(r["train_flops"] for r in points) > 3 * min(r["train_flops"] for r in points):
        ax.set_xscale("log")
    ax.margins(x=0.15, y=0.1)  # room for the labels of the outermost points
    ax.set_xlabel("training FLOPs (model, forward + backward)")
    ax.set_ylabel("final held-out loss")
    ax.set_title("quality vs compute", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def write_report(results: list[dict], workdir: Path, sweep: Sweep) -> None:
    """results.csv, results.md, loss_curves.png and quality_vs_flops.png in `workdir`."""
    write_csv(results, workdir / "results.csv", sweep.metrics)
    write_markdown(results, workdir / "results.md", sweep)
    plot_loss_curves(results, workdir / "loss_curves.png")
    plot_quality_vs_flops(results, workdir / "quality_vs_flops.png")
