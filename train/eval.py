"""python -m train.eval --model SRC [--data SOURCE] [--split heldout] [--batches N] [--step S]
    [--json]

Loss and perplexity of a model on the held-out (or train) split of a corpus: the next-token
cross-entropy of the main head over the tokens a run trains on (metadata prefixes excluded; for
chat data under train.loss_mask=assistant, the assistant turns).
- `--model SRC` (or `--workdir`): a `python -m train` workdir (its latest step, `--step S` or
  DIR/checkpoints/<step>), evaluated on its own data with its sequence length and batch; or any
  model `python -m train --init-from` takes (an RL workdir, a model directory, a Hugging Face
  directory) with `--data`.
- `--data SOURCE`: another corpus, as `train.data.source` names one (`stdlib`, `.txt`/`.jsonl`
  paths or globs, a prepared directory): its documents split by hash as a run splits them
  (`train.data.heldout_fraction`), read with the model's tokenizer (`--tokenizer` if SRC holds
  none).
"""

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
from tqdm import tqdm

from model.config.cli import ArgumentParser, report_error
from model.interop.model_dir import is_model_dir
from model.interop.workdir import Checkpointer, CheckpointError, split_checkpoint_step, workdir_kind
from model.lm import CausalLM, join_variables, output_head_params, split_variables
from model.tokenizers.text import load_tokenizer
from model.weights import checkpoint_tokenizer, load_model
from train.checkpoint import check_training_checkpoint
from train.config import RunConfig, TrainConfig, run_config_from_dict
from train.data.pipeline import make_dataset
from train.losses import chunked_cross_entropy, shifted_targets


def make_eval_step(model: CausalLM, chunk_size: int):
    """-> jitted fn(params, balance, batch [B, T] dict) -> (loss sum, target count)."""

    def eval_step(params, balance, batch):
        variables = join_variables(params, balance)
        out = model.apply(variables, batch["tokens"], batch["segment_ids"], batch["positions"],
                          compute_logits=False, num_mtp_heads=0)
        targets = shifted_targets(batch["tokens"], batch["segment_ids"], batch["meta_mask"], 1,
                                  jnp.bool_(True), batch.get("loss_mask"))
        project = lambda p, h: model.apply({"params": p}, h, method=CausalLM.project)  # noqa: E731
        return chunked_cross_entropy(project, output_head_params(model.config, params),
                                     out.hidden, targets, chunk_size)

    return jax.jit(eval_step)


def evaluate(eval_step, params, balance, batches, progress: bool = False) -> dict:
    """Mean loss and perplexity over `batches` (an iterable of [B, T] batch dicts)."""
    total, count, num = 0.0, 0.0, 0
    for batch in tqdm(batches, desc="eval", disable=not progress, file=sys.stderr):
        loss_sum, weight = eval_step(params, balance, batch)
        total, count, num = total + float(loss_sum), count + float(weight), num + 1
    if count == 0:
        raise ValueError("evaluation data has no trainable targets")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(count),
            "batches": num}


def limited(iterator, n: int):
    for _, item in zip(range(n), iterator):
        yield item


def evaluate_checkpoint(source: Path, split: str, batches: int, step: int | None = None,
                        progress: bool = False, *, data: str | None = None, tokenizer: str = "",
                        seq_len: int | None = None, batch_size: int | None = None) -> dict:
    """`evaluate` of `source`'s weights on its run's data, or on `data`; `seq_len` and
    `batch_size` default to the run's (512 and 8 without one)."""
    source, step, run = _source_run(source, step, data is not None)
    defaults = run.train if run is not None else TrainConfig()
    config, variables = load_model(source if step is None else source / "checkpoints" / str(step))
    text = (load_tokenizer(run.train.data.tokenizer) if run is not None and not tokenizer
            else checkpoint_tokenizer(source, tokenizer))
    data_cfg = defaults.data if data is None else dataclasses.replace(
        defaults.data, source=data, mixture={}, tokenizer=text.name,
        meta_tokens=defaults.data.meta_tokens if run is not None else False)
    seq_len = seq_len or (run.train.seq_len if run is not None else 512)
    batch_size = batch_size or (run.train.micro_batch() if run is not None else 8)
    batch_iter = make_dataset(data_cfg, text, seq_len=seq_len, batch_size=batch_size,
                              split=split, seed=defaults.seed, loss_mask=defaults.loss_mask)
    params, balance = split_variables(variables)
    result = evaluate(make_eval_step(CausalLM(config), defaults.loss_chunk_size), params, balance,
                      limited(batch_iter, batches), progress)
    return {"model": str(source), "step": step, "data": data_cfg.source, "split": split,
            **result}


def _source_run(source: Path, step: int | None, has_data: bool
                ) -> tuple[Path, int | None, RunConfig | None]:
    """(the directory, the step of a workdir, its training run config or None): a workdir's
    step must exist, and without `--data` it must be a training run's."""
    source, named = split_checkpoint_step(Path(source))
    if named is not None and step is not None and named != step:
        raise ValueError(f"--step {step}: {source / 'checkpoints' / str(named)} names step {named}")
    step = named if step is None else step
    if is_model_dir(source) or (source / "config.json").is_file():
        if not has_data:
            raise ValueError(f"--data: {source} is a model directory without training data; name "
                             "the corpus to evaluate on")
        return source, None, None
    if not source.exists():
        raise ValueError(f"{source} does not exist")
    checkpoints = Checkpointer(source / "checkpoints", keep=1 << 30)
    try:
        saved = checkpoints.all_steps()
        if not saved:
            raise CheckpointError(f"no checkpoint in {source / 'checkpoints'}")
        step = saved[-1] if step is None else step
        if step not in saved:
            raise CheckpointError(f"--step {step}: {source} has no checkpoint of that step; "
                                  f"saved steps: {', '.join(map(str, saved))}")
        saved = checkpoints.read_config(step)
    finally:
        checkpoints.close()
    if workdir_kind(saved) != "train" and has_data:
        return source, step, None
    check_training_checkpoint(saved, source, "its held-out accuracy is eval/accuracy in its "
                              "metrics.jsonl (python -m rl.compare compares RL runs)")
    return source, step, run_config_from_dict(saved)


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m train.eval", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "--workdir", dest="model", required=True, metavar="SRC",
                        help="a `python -m train` workdir (its data), or any model with --data")
    parser.add_argument("--data", metavar="SOURCE",
                        help="evaluate on this corpus instead of the run's (train.data.source)")
    parser.add_argument("--split", choices=("heldout", "train"), default="heldout")
    parser.add_argument("--batches", type=int, default=50, metavar="N",
                        help="evaluate at most N batches (default 50)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--seq-len", type=int, default=None, metavar="T",
                        help="tokens per row (default: the run's, else 512)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="B",
                        help="rows per batch (default: the run's micro-batch, else 8)")
    parser.add_argument("--tokenizer", default="", metavar="PATH",
                        help="tokenizer.json (or its directory), if SRC holds none")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    for flag in ("batches", "seq_len", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value < (2 if flag == "seq_len" else 1):
            parser.error(f"--{flag.replace('_', '-')} must be >= {2 if flag == 'seq_len' else 1}, "
                         f"got {value}")
    try:
        result = evaluate_checkpoint(Path(args.model), args.split, args.batches, args.step,
                                     progress=not args.json, data=args.data,
                                     tokenizer=args.tokenizer, seq_len=args.seq_len,
                                     batch_size=args.batch_size)
    except (CheckpointError, ValueError, OSError) as err:
        return report_error(err)
    if args.json:
        print(json.dumps(result))
    else:
        where = f"step {result['step']}" if result["step"] is not None else result["model"]
        print(f"{where} {result['data']} {result['split']}: loss {result['loss']:.4f}  perplexity "
              f"{result['perplexity']:.2f}  ({result['tokens']} tokens, {result['batches']} batches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
