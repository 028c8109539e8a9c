"""python -m train.eval --workdir DIR [--split heldout] [--batches N] [--step S] [--json]

Loss and perplexity of a run's checkpoint on the held-out (or train) split of its data: the
next-token cross-entropy of the main head over the tokens the run trains on (metadata prefixes
excluded; for chat data under train.loss_mask=assistant, the assistant turns).
"""

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
from tqdm import tqdm

from model.config.cli import ArgumentParser, report_error
from model.interop.workdir import Checkpointer, CheckpointError, restore_target
from model.lm import CausalLM, join_variables, output_head_params
from model.tokenizers.text import load_tokenizer
from train.checkpoint import check_training_checkpoint
from train.config import run_config_from_dict
from train.data.pipeline import make_dataset
from train.losses import chunked_cross_entropy, shifted_targets
from train.state import abstract_state, build_training


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


def evaluate_checkpoint(workdir: Path, split: str, batches: int, step: int | None = None,
                        progress: bool = False) -> dict:
    checkpoints = Checkpointer(workdir / "checkpoints", keep=1 << 30)
    try:
        saved = checkpoints.all_steps()
        if not saved:
            raise CheckpointError(f"no checkpoint in {workdir / 'checkpoints'}")
        step = saved[-1] if step is None else step
        if step not in saved:
            raise CheckpointError(f"--step {step}: {workdir} has no checkpoint of that step; "
                                  f"saved steps: {', '.join(map(str, saved))}")
        saved = checkpoints.read_config(step)
        check_training_checkpoint(saved, workdir, "its held-out accuracy is eval/accuracy in "
                                  "its metrics.jsonl (python -m rl.compare compares RL runs)")
        run = run_config_from_dict(saved)
        training = build_training(run)
        # Onto this process's first device, whatever mesh or process count saved it.
        state, _ = checkpoints.restore(step, restore_target(
            abstract_state(training, run.train.seed),
            jax.sharding.SingleDeviceSharding(jax.devices()[0])))
    finally:
        checkpoints.close()
    tokenizer = load_tokenizer(run.train.data.tokenizer)
    data = make_dataset(run.train.data, tokenizer, seq_len=run.train.seq_len,
                        batch_size=run.train.micro_batch(), split=split, seed=run.train.seed,
                        loss_mask=run.train.loss_mask)
    result = evaluate(make_eval_step(training.model, run.train.loss_chunk_size), state.params,
                      state.balance, limited(data, batches), progress)
    return {"step": step, "split": split, **result}


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m train.eval", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, metavar="DIR", help="a `python -m train` workdir")
    parser.add_argument("--split", choices=("heldout", "train"), default="heldout")
    parser.add_argument("--batches", type=int, default=50, metavar="N",
                        help="evaluate at most N batches (default 50)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.error(f"--batches must be >= 1, got {args.batches}")
    try:
        result = evaluate_checkpoint(Path(args.workdir), args.split, args.batches, args.step,
                                     progress=not args.json)
    except (CheckpointError, ValueError) as err:
        return report_error(err)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"step {result['step']} {result['split']}: loss {result['loss']:.4f}  perplexity "
              f"{result['perplexity']:.2f}  ({result['tokens']} tokens, {result['batches']} batches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
