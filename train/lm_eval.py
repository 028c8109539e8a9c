"""python -m train.lm_eval --model SRC --tasks NAMES [--include-path DIR] [--limit N]
    [--num-fewshot K] [--batch-size B] [--max-length L] [--json]
    [--output-path DIR --log-samples]

Benchmarks through lm-evaluation-harness (the `eval` extra: `pip install -e '.[eval]'`): any of
its tasks, or your own YAML tasks in `--include-path`, on a stepjax model
(model/inference/harness.py: log-likelihoods and greedy generation with the KV-cache decoder).

- `--model SRC`: a `python -m train` or `python -m rl` workdir (its latest step; a step other
  than the latest as DIR/checkpoints/<step>), a stepjax model directory or a Hugging Face
  directory, as `python -m train --init-from` takes them; its tokenizer is the workdir's, the
  directory's tokenizer.json or `--tokenizer`.
- `--tasks`: comma-separated task or group names (or YAML paths). Tasks found in
  `--include-path` are used without indexing lm-eval's built-in tasks (about 20 s); built-in
  tasks download their datasets through Hugging Face `datasets` (set HF_DATASETS_OFFLINE=1 and
  HF_HUB_OFFLINE=1 to stay offline on local tasks).
- `--max-length`: the decoder's cache, the longest context scored or generated from (default:
  the length a training workdir trained at, else 2048).
Prints lm-eval's table, or with `--json` one object holding lm-eval's `results` (per task
metric -> value, and its standard error) with `n-samples`, `n-shot` and `versions`.
`--output-path DIR` writes lm-eval's results file there (and with `--log-samples` every
sample's request and response).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

from model.config.cli import ArgumentParser, finite_float, report_error
from model.interop.workdir import CheckpointError, latest_run_config, split_checkpoint_step

BUILTIN_INDEX_NOTE = "indexing lm-eval's built-in tasks (about 20 s)"
DEFAULT_MAX_LENGTH = 2048  # lm-eval's Hugging Face backend's default


def harness_available() -> None:
    """Raises ValueError naming the extra when lm-eval is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError("lm-evaluation-harness is not installed: pip install -e '.[eval]' "
                         "(or pip install lm-eval)") from None


def task_manager(names: Sequence[str], include_path: str | None):
    """lm-eval's TaskManager for `names`: only `include_path`'s tasks when it holds them all,
    else with lm-eval's built-in tasks too. ValueError naming tasks found in neither."""
    from lm_eval.tasks import TaskManager

    if include_path and not Path(include_path).is_dir():
        raise ValueError(f"--include-path: {include_path} is not a directory")

    def unknown(manager) -> list[str]:
        return [n for n in names if not manager.match_tasks([n]) and not Path(n).is_file()]

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if not unknown(local):
            return local
    print(BUILTIN_INDEX_NOTE, file=sys.stderr)
    manager = TaskManager(include_path=include_path)
    missing = unknown(manager)
    if missing:
        raise ValueError(f"--tasks: no task {', '.join(map(repr, missing))} in lm-eval"
                         + (f" or {include_path}" if include_path else "")
                         + "; `lm-eval ls tasks` lists them")
    return manager


def evaluate_tasks(lm, names: Sequence[str], manager, *, limit: float | None,
                   num_fewshot: int | None, bootstrap_iters: int = 100_000,
                   log_samples: bool = False, tracker=None, model_name: str = "",
                   keep_global_seeds: bool = False) -> dict:
    """lm-eval's `simple_evaluate` of `lm` on tasks `names`. `keep_global_seeds`: leave
    Python's, NumPy's and torch's global random states alone (inside a training run)."""
    from lm_eval import simple_evaluate

    seeds = {"random_seed": None, "numpy_random_seed": None,
             "torch_random_seed": None} if keep_global_seeds else {}
    return simple_evaluate(model=lm, model_args={"model": model_name}, tasks=list(names),
                           task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                           bootstrap_iters=bootstrap_iters, log_samples=log_samples,
                           evaluation_tracker=tracker, **seeds)


def task_metrics(results: dict) -> dict[str, float]:
    """{"eval/<task>/<metric>": value} of lm-eval's `results` (numbers only; the filter is
    named when it is not lm-eval's default `none`, standard errors are left out)."""
    metrics = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, kind = key.partition(",")
            if not kind or "_stderr" in metric or not isinstance(value, (int, float)):
                continue
            name = metric if kind == "none" else f"{metric}_{kind}"
            metrics[f"eval/{task}/{name}"] = float(value)
    return metrics


def trained_length(source: str) -> int:
    """The sequence length a `python -m train` workdir trained at, else DEFAULT_MAX_LENGTH."""
    workdir, step = split_checkpoint_step(Path(source))
    if not (workdir / "checkpoints").is_dir():
        return DEFAULT_MAX_LENGTH
    return latest_run_config(workdir, step)[1].get("train", {}).get("seq_len", DEFAULT_MAX_LENGTH)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m train.lm_eval", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="SRC",
                        help="workdir, DIR/checkpoints/<step>, model directory or HF directory")
    parser.add_argument("--tasks", required=True, metavar="NAMES",
                        help="comma-separated lm-eval task or group names (or YAML paths)")
    parser.add_argument("--include-path", metavar="DIR", help="a directory of task YAMLs")
    parser.add_argument("--limit", type=finite_float, metavar="N",
                        help="at most N samples per task (a fraction of them if < 1)")
    parser.add_argument("--num-fewshot", type=int, metavar="K",
                        help="few-shot examples per prompt (default: each task's own)")
    parser.add_argument("--batch-size", type=int, default=8, metavar="B",
                        help="rows per decoder batch (default 8)")
    parser.add_argument("--max-length", type=int, default=None, metavar="L",
                        help="KV-cache positions, the longest context (default: a training "
                             f"workdir's train.seq_len, else {DEFAULT_MAX_LENGTH})")
    parser.add_argument("--max-gen-toks", type=int, default=256, metavar="N",
                        help="new tokens for generation tasks that set none (default 256)")
    parser.add_argument("--prefill-chunk", type=int, default=256, metavar="C",
                        help="tokens per prefill / scoring pass (default 256)")
    parser.add_argument("--tokenizer", default="", metavar="PATH",
                        help="tokenizer.json (or its directory), if SRC holds none")
    parser.add_argument("--bootstrap-iters", type=int, default=100_000, metavar="N",
                        help="bootstrap resamples for standard errors (lm-eval's default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of generation tasks")
    parser.add_argument("--output-path", metavar="DIR", help="write lm-eval's results file here")
    parser.add_argument("--log-samples", action="store_true",
                        help="with --output-path: also every sample's request and response")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def check_args(parser: ArgumentParser, args) -> list[str]:
    """The task names; a usage error (exit 2) for any bad value."""
    names = [n.strip() for n in args.tasks.split(",") if n.strip()]
    if not names:
        parser.error("--tasks: name at least one task")
    for flag in ("batch_size", "max_length", "max_gen_toks", "prefill_chunk"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.limit is not None and args.limit <= 0:
        parser.error(f"--limit must be > 0, got {args.limit:g}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        parser.error(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    if args.bootstrap_iters < 0:
        parser.error(f"--bootstrap-iters must be >= 0, got {args.bootstrap_iters}")
    if args.log_samples and not args.output_path:
        parser.error("--log-samples needs --output-path DIR")
    return names


def run(args, names: list[str]) -> dict:
    from lm_eval.loggers import EvaluationTracker

    from model.inference.decode import Decoder
    from model.inference.harness import HarnessLM
    from model.weights import checkpoint_tokenizer, load_model

    manager = task_manager(names, args.include_path)  # unknown tasks fail before loading
    tokenizer = checkpoint_tokenizer(Path(args.model), args.tokenizer)
    config, variables = load_model(args.model)
    decoder = Decoder(config, variables, max_len=args.max_length or trained_length(args.model),
                      prefill_chunk=args.prefill_chunk)
    lm = HarnessLM(decoder, tokenizer, batch_size=args.batch_size,
                   max_gen_toks=args.max_gen_toks, seed=args.seed, progress=not args.json)
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = evaluate_tasks(lm, names, manager, limit=limit, num_fewshot=args.num_fewshot,
                             bootstrap_iters=args.bootstrap_iters,
                             log_samples=args.log_samples, tracker=tracker,
                             model_name=args.model)
    if tracker is not None:
        samples = results.pop("samples", None)
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"] if samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = check_args(parser, args)
    try:
        harness_available()
    except ValueError as err:
        return report_error(err)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    try:
        results = run(args, names)
    except (ValueError, KeyError, OSError, CheckpointError) as err:
        return report_error(err)
    if args.json:
        print(json.dumps(summary(results), default=str))
    else:
        from lm_eval.utils import make_table

        print(make_table(results))
    return 0


def summary(results: dict) -> dict[str, Any]:
    """What --json prints: lm-eval's per-task `results` and how they were obtained."""
    return {key: results[key] for key in ("results", "groups", "n-samples", "n-shot", "versions",
                                          "higher_is_better") if key in results}


if __name__ == "__main__":
    sys.exit(main())
