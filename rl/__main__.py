"""python -m rl --config configs/rl_arith.yaml --workdir DIR [--init-from DIR_or_HF] [key=value ...]

Reinforcement learning with verifiable rewards (report 5.2): MIS-PO by default, or PPO, GRPO
(DeepSeekMath's), GSPO, DAPO, Dr. GRPO and Kimi K2.5's objective with `rl.algorithm=...`, each
as its paper writes it (rl/config.py); on-policy distillation from a
teacher per task (`task.tasks.<name>.teacher.checkpoint`, rl/distill/) under any of them or
MiMo's MOPD (`rl.algorithm=mopd`). `--init-from` takes the starting policy: a
`python -m train` workdir (e.g. the SFT warm start of configs/sft_arith.yaml), a `python -m rl`
workdir (its actor), either's step DIR/checkpoints/<step>, a stepjax model directory or a
Hugging Face checkpoint. Re-running the
same command resumes from the latest checkpoint in DIR (then --init-from is not needed).
Writes DIR/metrics.jsonl, DIR/tensorboard/, DIR/checkpoints/ and DIR/config.yaml (the resolved
config, which --config reads back); SIGTERM/SIGINT save a checkpoint and exit cleanly.
`--print-config` prints the resolved config and exits.
"""

import argparse
import sys
from pathlib import Path
from typing import Sequence

from model.config import config_yaml
from model.config.cli import ArgumentParser, report_error
from model.interop.workdir import CheckpointError
from model.interop.workdir_lock import WorkdirInUse
from model.weights import load_model_config
from rl.config import load_rl_config
from rl.loop import run_rl
from train.loop import TrainingError


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m rl", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, metavar="PATH",
                        help="RL YAML (rl:, task: and optionally model: sections)")
    parser.add_argument("--workdir", metavar="DIR",
                        help="where checkpoints and metrics go; an existing run there is resumed")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML (the model from --init-from, read "
                             "without its weights) and exit; needs no --workdir")
    parser.add_argument("--init-from", metavar="DIR_or_HF", default=None,
                        help="starting policy: training or RL workdir (or its step "
                             "DIR/checkpoints/<step>), model directory or HF checkpoint")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. rl.algorithm=ppo rl.iterations=20")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    try:
        run = load_rl_config(args.config, args.overrides)
        if args.print_config:
            if args.init_from:
                run = run.with_model(load_model_config(args.init_from), checkpoint=True)
            print(config_yaml(run.to_dict()), end="")
            return 0
    except (ValueError, CheckpointError) as err:
        parser.error(str(err))
    if not args.workdir:
        parser.error("--workdir DIR is required")
    workdir = Path(args.workdir)
    try:
        summary = run_rl(run, workdir, init_from=args.init_from)
    except (TrainingError, CheckpointError, WorkdirInUse, ValueError, OSError) as err:
        return report_error(err)
    if summary.first_iteration == summary.last_iteration and not summary.interrupted:
        print(f"nothing to do: {workdir} is already at iteration {summary.last_iteration} "
              f"(rl.iterations={run.rl.iterations}); raise rl.iterations to continue")
        return 0
    state = "interrupted" if summary.interrupted else "finished"
    print(f"{state} at iteration {summary.last_iteration} (started at {summary.first_iteration})")
    if summary.accuracy_before is not None and summary.accuracy_after is not None:
        print(f"held-out accuracy (greedy): {summary.accuracy_before:.3f} -> "
              f"{summary.accuracy_after:.3f}")
    print(f"metrics:     {workdir / 'metrics.jsonl'} (plot: python -m train.plot --workdir {workdir})")
    print(f"checkpoints: {workdir / 'checkpoints'}")
    if summary.interrupted:
        print("re-run the same command to resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())
