"""Ablation sweeps: one base run config, a grid and/or a list of overridden runs.

    python -m train.sweep --sweep configs/sweeps/layout.yaml --workdir runs/sweep_layout \\
        [--only NAME] [--list] [key=value ...]

Sweep file (YAML):

    base: configs/tiny.yaml             # run config every run starts from
    overrides: ["train.steps=150"]      # applied to every run, first
    grid: {train.lr: [1e-3, 3e-3]}      # cartesian product of the listed values
    runs:                               # named runs with their own overrides
      - {name: S3F1, overrides: ["model.layout=F+SSSF*2"]}
      - {name: MiMo, base: configs/tiny_mimo.yaml}  # optional: the run's own base
    metrics: [moe/load_max_over_mean]   # optional: more columns (last logged value)
    description: ...                    # optional: printed above the results table

With both `grid` and `runs`, every run is trained at every grid point. `key=value` overrides on
the command line apply to every run, last (e.g. `train.seed=1` to repeat a sweep with another
seed in another DIR). Each run trains in DIR/runs/NAME with `python -m train`'s loop; re-running
the command skips finished runs and resumes unfinished ones; it refuses, writing nothing, a DIR
whose runs were trained with other settings (a changed sweep file or other command-line
overrides). A run that fails is reported with its reason and the others go on. Afterwards DIR
holds results.csv, results.md, loss_curves.png and quality_vs_flops.png
(train/experiments/sweep_report.py). Runs end with a held-out evaluation: a run without
`train.eval_every` gets `train.eval_every=<train.steps>`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from model.config.cli import ArgumentParser, report_error
from model.interop.workdir import CheckpointError, latest_checkpoint_step
from model.interop.workdir_lock import WorkdirInUse, workdir_lock
from train.checkpoint import changed_since_checkpoint
from train.experiments.sweep_file import Sweep, load_sweep
from train.experiments.sweep_report import STATUS_FILE, collect_results, write_report
from train.loop import TrainingError, train


@dataclasses.dataclass
class SweepOutcome:
    trained: list[str]  # runs this invocation trained (or resumed)
    skipped: list[str]  # already finished
    failed: dict[str, str]  # name -> one-line reason
    interrupted: bool


def check_workdir(sweep: Sweep, workdir: Path) -> None:
    """Raises ValueError if a run's directory under `workdir` holds checkpoints of another
    config (a changed sweep file or other command-line overrides): its results would be reported,
    or its training resumed, under settings it was not trained with."""
    for run in sweep.runs:
        run_dir = workdir / "runs" / run.name
        if latest_checkpoint_step(run_dir) is None:
            continue
        changed = changed_since_checkpoint(run_dir, sweep.run_config(run))
        if changed:
            raise ValueError(f"run {run.name}: {run_dir} holds checkpoints of a different config "
                             f"({', '.join(changed)}); restore the sweep's settings or use "
                             "another --workdir")


def run_sweep(sweep: Sweep, workdir: Path, only: Sequence[str] = (),
              log: Callable[[str], None] = print,
              allow_data_change: bool = False) -> SweepOutcome:
    """Trains the runs of `sweep` (those named in `only`, if given) under `workdir`/runs, then
    writes the report of every run that has metrics. Refuses (ValueError, nothing written) a
    workdir whose runs were trained with other settings, and (WorkdirInUse) one another sweep
    is writing. `allow_data_change`: as `train.loop.train`'s, for every run."""
    check_workdir(sweep, workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with workdir_lock(workdir):
        return _run_locked(sweep, workdir, only, log, allow_data_change)


def _run_locked(sweep: Sweep, workdir: Path, only: Sequence[str],
                log: Callable[[str], None], allow_data_change: bool) -> SweepOutcome:
    (workdir / "sweep.json").write_text(json.dumps({
        "base": str(sweep.base), "overrides": list(sweep.overrides),
        "command_line": list(sweep.command_line),
        "runs": [{"name": r.name, "base": str(sweep.run_base(r)), "overrides": list(r.overrides)}
                 for r in sweep.runs]},
        indent=2) + "\n")
    selected = [r for r in sweep.runs if not only or r.name in only]
    outcome = SweepOutcome([], [], {}, False)
    for index, run in enumerate(selected, 1):
        config, run_dir = sweep.run_config(run), workdir / "runs" / run.name
        done = latest_checkpoint_step(run_dir)
        if done is not None and done >= config.train.steps:
            log(f"[{index}/{len(selected)}] {run.name}: finished (step {done}), skipped")
            outcome.skipped.append(run.name)
            continue
        log(f"[{index}/{len(selected)}] {run.name}: "
            + (f"resuming at step {done}" if done else "training") + f" -> {run_dir}")
        start = time.perf_counter()
        try:
            summary = train(config, run_dir, allow_data_change=allow_data_change)
        except (TrainingError, CheckpointError, WorkdirInUse, ValueError, OSError) as err:
            outcome.failed[run.name] = " ".join(str(err).split())
            log(f"[{index}/{len(selected)}] {run.name}: FAILED: {outcome.failed[run.name]}")
            continue
        finally:
            _add_seconds(run_dir, time.perf_counter() - start)
        outcome.trained.append(run.name)
        if summary.interrupted:
            outcome.interrupted = True
            break
    results = collect_results(sweep, workdir)
    if results:
        write_report(results, workdir, sweep)
    return outcome


def _add_seconds(run_dir: Path, seconds: float) -> None:
    path = run_dir / STATUS_FILE
    if not run_dir.is_dir():
        return
    previous = json.loads(path.read_text()).get("train_seconds", 0.0) if path.is_file() else 0.0
    path.write_text(json.dumps({"train_seconds": previous + seconds}) + "\n")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m train.sweep", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", required=True, metavar="PATH", help="sweep YAML")
    parser.add_argument("--workdir", required=True, metavar="DIR",
                        help="sweep directory: runs/NAME per run, results.* and plots")
    parser.add_argument("--only", metavar="NAME", action="append", default=[],
                        help="train only this run (repeatable), e.g. to spread a sweep over "
                             "machines sharing DIR; the report covers every run with metrics")
    parser.add_argument("--allow-data-change", action="store_true",
                        help="resume runs although their data files changed since they started "
                             "(the new data is recorded)")
    parser.add_argument("--list", action="store_true",
                        help="print the expanded runs and their overrides, train nothing")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides for every run, applied last, e.g. train.seed=1")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    try:
        sweep = load_sweep(args.sweep, args.overrides)
    except ValueError as err:
        parser.error(str(err))
    names = [r.name for r in sweep.runs]
    unknown = [n for n in args.only if n not in names]
    if unknown:
        parser.error(f"--only: no run named {', '.join(unknown)} (runs: {', '.join(names)})")
    if args.list:
        for run in sweep.runs:
            base = f"(base {run.base}) " if run.base else ""
            print(f"{run.name}: {base}{' '.join(sweep.run_overrides(run))}")
        return 0
    workdir = Path(args.workdir)
    try:
        outcome = run_sweep(sweep, workdir, args.only,
                            allow_data_change=args.allow_data_change)
    except OSError as err:
        return report_error(f"sweep {workdir}: {err.strerror or err}")
    except (ValueError, CheckpointError, WorkdirInUse) as err:
        return report_error(err)
    print(f"trained {len(outcome.trained)}, already finished {len(outcome.skipped)}, "
          f"failed {len(outcome.failed)}; results: {workdir / 'results.md'}")
    if outcome.interrupted:
        print("interrupted; re-run the same command to resume")
    for name, reason in outcome.failed.items():
        print(f"error: run {name}: {reason}", file=sys.stderr)
    return 1 if outcome.failed else 0


if __name__ == "__main__":
    sys.exit(main())
