"""python -m train --config configs/tiny.yaml --workdir DIR [model.x=... train.y=...]
python -m train --recipe configs/recipes/tiny_staged.yaml --workdir DIR [overrides]
python -m train --config configs/tiny.yaml --print-config [overrides]

Trains a model from a run YAML (`model:` and `train:` sections), or runs a staged recipe: each
stage a training run in DIR/stages/<kk>-<name> starting from the previous stage's weights
(train/experiments/recipe.py documents the format). Re-running the same command resumes from the
latest checkpoint in DIR (for a recipe: skips finished stages). Writes DIR/metrics.jsonl,
DIR/tensorboard/, DIR/checkpoints/ and DIR/config.yaml (the resolved config, which --config
reads back). SIGTERM/SIGINT save a checkpoint after the current step and exit cleanly; a second
one exits at once (status 130 for Ctrl-C), keeping earlier checkpoints.
`--init-from SRC` starts a new run (a recipe: its first stage) from SRC's weights with a new
optimizer state and schedule: fine-tuning (train/init_from.py).

Multi-host: start the same command once per host with --coordinator HOST:PORT (process 0's
address and a free port), --num-processes N and --process-id 0..N-1 (or the environment variables
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); under SLURM (srun), Open MPI
(mpirun), TPU pods or Kubernetes jobs they are detected. All processes share one --workdir (a
shared filesystem); process 0 writes the metrics. CPU processes use gloo collectives.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from model.config import config_yaml
from model.config.cli import ArgumentParser, finite_float, report_error
from model.interop.workdir import CheckpointError
from model.interop.workdir_lock import WorkdirInUse
from train.config import RunConfig, load_run_config
from train.experiments.recipe import Recipe, load_recipe, run_recipe
from train.init_from import source_model_values
from train.loop import TrainingError, TrainSummary, train
from train.parallel.distributed import (
    DEFAULT_TIMEOUT_S,
    DistributedError,
    initialize,
    is_lead,
)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m train", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", metavar="PATH", help="run YAML")
    source.add_argument("--recipe", metavar="PATH",
                        help="staged recipe YAML; overrides apply to every stage")
    parser.add_argument("--workdir", metavar="DIR",
                        help="where checkpoints and metrics go; an existing run there is resumed")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML (a recipe: one document per "
                             "stage) and exit; needs no --workdir and builds nothing")
    parser.add_argument("--init-from", metavar="SRC", default=None,
                        help="start from these weights, with a new optimizer state and schedule "
                             "(fine-tuning): a workdir (its latest step), DIR/checkpoints/<step>, "
                             "a model directory or a Hugging Face directory; a run YAML without "
                             "a model: section takes SRC's model (train.init_from)")
    parser.add_argument("--allow-data-change", action="store_true",
                        help="resume although the data files changed since the run started "
                             "(the new data is recorded)")
    multi = parser.add_argument_group(
        "multi-process (default: one process, unless a SLURM / Open MPI / TPU / k8s job is "
        "detected)")
    multi.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                       help="address of process 0 and a free port it listens on "
                            "(env JAX_COORDINATOR_ADDRESS)")
    multi.add_argument("--num-processes", type=int, metavar="N", default=None,
                       help="number of processes, all started with the same arguments "
                            "(env JAX_NUM_PROCESSES; 1 = single process, no cluster detection)")
    multi.add_argument("--process-id", type=int, metavar="I", default=None,
                       help="this process's index in [0, N) (env JAX_PROCESS_ID)")
    multi.add_argument("--coordinator-timeout", type=finite_float, metavar="S",
                       default=DEFAULT_TIMEOUT_S,
                       help="seconds every process has to reach the coordinator before the "
                            f"run stops with an error (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. train.steps=100 train.lr=1e-3 model.d_model=256")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # a bare `python -m train`: show how it is called, then the one-line error
        parser.print_usage(sys.stderr)
        parser.error("--config PATH (or --recipe PATH) and --workdir DIR are required")
    args = parser.parse_intermixed_args(argv)
    try:
        if args.init_from:  # quoted, so a path reads as a string whatever it looks like
            args.overrides.append(f"train.init_from={json.dumps(os.path.normpath(args.init_from))}")
        if args.recipe:
            recipe = load_recipe(args.recipe, args.overrides)
        else:
            run = load_run_config(args.config, args.overrides, model=source_model_values(
                args.init_from) if args.init_from else None)
    except ValueError as err:
        parser.error(str(err))
    if args.print_config:
        print_config(recipe if args.recipe else None, None if args.recipe else run, args.overrides)
        return 0
    if not args.workdir:
        parser.error("--workdir DIR is required")
    try:  # before anything touches devices
        initialize(args.coordinator, args.num_processes, args.process_id,
                   timeout_seconds=args.coordinator_timeout)
    except DistributedError as err:
        parser.error(str(err))
    workdir = Path(args.workdir)
    try:
        if args.recipe:
            outcome = run_recipe(recipe, workdir, args.overrides,
                                 log=print if is_lead() else lambda _: None,
                                 allow_data_change=args.allow_data_change)
        else:
            summary = train(run, workdir, allow_data_change=args.allow_data_change)
    except (TrainingError, CheckpointError, WorkdirInUse, ValueError, OSError) as err:
        return report_error(err)
    if not is_lead():  # process 0 reports for all
        return 0
    if args.recipe:
        for name, stage_summary in outcome.summaries.items():
            print(f"stage {name}: {outcome_line(stage_summary)} ({stage_summary.workdir})")
        if outcome.interrupted:
            print("re-run the same command to resume")
        if not outcome.summaries:
            print(f"nothing to do: every stage in {workdir} is finished")
        print(f"all stages on one plot: python -m train.plot --workdir {workdir}")
        return 0
    if not summary.losses and not summary.interrupted:
        print(f"nothing to do: {workdir} is already at step {summary.last_step} "
              f"(train.steps={run.train.steps}); raise train.steps to train further")
        return 0
    report(summary)
    return 0


def print_config(recipe: Recipe | None, run: RunConfig | None, overrides: Sequence[str]) -> None:
    """The resolved config as YAML: a run's, or every recipe stage's as its own document."""
    if run is not None:
        print(config_yaml(run.to_dict()), end="")
        return
    for i, stage in enumerate(recipe.stages):
        print(f"--- # stage {stage.name}")
        print(config_yaml(recipe.stage_config(i, overrides).to_dict()), end="")


def outcome_line(summary: TrainSummary) -> str:
    state = "interrupted" if summary.interrupted else "finished"
    first = summary.losses[0] if summary.losses else float("nan")
    last = summary.losses[-1] if summary.losses else float("nan")
    return (f"{state} at step {summary.last_step} (started at {summary.first_step}); "
            f"loss {first:.3f} -> {last:.3f}; skipped updates: {summary.skipped}")


def report(summary: TrainSummary) -> None:
    """What a finished or interrupted run did and where its outputs are."""
    workdir = summary.workdir
    print(outcome_line(summary))
    print(f"metrics:     {workdir / 'metrics.jsonl'} (TensorBoard: {workdir / 'tensorboard'}; "
          f"plot: python -m train.plot --workdir {workdir})")
    print(f"checkpoints: {workdir / 'checkpoints'} (resolved config: {workdir / 'config.yaml'})")
    if summary.interrupted:
        print("re-run the same command to resume")


if __name__ == "__main__":
    sys.exit(main())
