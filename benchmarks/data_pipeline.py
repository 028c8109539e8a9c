"""Input pipeline throughput on the embedded stdlib corpus (train split, default tokenizer).

    python -m benchmarks.data_pipeline [--seq-len 256] [--batch-size 8] [--batches 400]

Reports tokens/s of `train.data.pipeline.make_dataset` after warm-up (the first batch fills the row
shuffle window), the latency of the first batch and of a checkpoint restore, the tokenizer's
raw encode rate, and the headroom over what a training step consumes (`--consumer-tokens-per-s`,
default 30k: the upper end of the tiny model on a 2-core CPU). Target: >= 10x headroom.
"""

import argparse
import json
import time

from benchmarks.common import markdown_table, save
from model.config.cli import finite_float
from model.tokenizers.text import load_tokenizer
from train.config import DataConfig
from train.data.corpus import load_documents
from train.data.documents import split_documents
from train.data.pipeline import make_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=20, help="batches before timing")
    parser.add_argument("--batches", type=int, default=400, help="timed batches")
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--consumer-tokens-per-s", type=finite_float, default=30_000.0)
    args = parser.parse_args()
    if args.consumer_tokens_per_s <= 0:
        parser.error(f"--consumer-tokens-per-s must be > 0, got {args.consumer_tokens_per_s}")

    cfg = DataConfig(num_workers=args.num_workers)
    tokenizer = load_tokenizer(cfg.tokenizer)
    start = time.perf_counter()
    docs = split_documents(load_documents(cfg.source), cfg.heldout_fraction)[0]
    load_seconds = time.perf_counter() - start
    texts = [d.text for d in docs]
    start = time.perf_counter()
    corpus_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    encode_rate = corpus_tokens / (time.perf_counter() - start)

    make = lambda: make_dataset(cfg, tokenizer, seq_len=args.seq_len, batch_size=args.batch_size,
                                split="train", seed=0)
    start = time.perf_counter()
    data = make()
    next(data)
    first_batch = time.perf_counter() - start
    for _ in range(args.warmup):
        next(data)
    tokens = padding = 0
    start = time.perf_counter()
    for _ in range(args.batches):
        batch = next(data)
        tokens += batch["tokens"].size
        padding += int((batch["segment_ids"] == 0).sum())
    rate = tokens / (time.perf_counter() - start)

    state = json.loads(json.dumps(data.get_state()))
    start = time.perf_counter()
    resumed = make()
    resumed.set_state(state)
    next(resumed)
    restore = time.perf_counter() - start

    headroom = rate / args.consumer_tokens_per_s
    record = {
        "seq_len": args.seq_len, "batch_size": args.batch_size, "num_workers": args.num_workers,
        "train_documents": len(docs), "train_epoch_tokens": corpus_tokens,
        "corpus_load_s": load_seconds, "tokenizer_encode_tokens_per_s": encode_rate,
        "pipeline_tokens_per_s": rate, "padding_fraction": padding / tokens,
        "first_batch_s": first_batch, "restore_and_first_batch_s": restore,
        "consumer_tokens_per_s": args.consumer_tokens_per_s, "headroom": headroom,
    }
    print(markdown_table(["measure", "value"], [
        ["train documents / tokens per epoch", f"{len(docs)} / {corpus_tokens / 1e6:.2f}M"],
        ["tokenizer encode (1 thread)", f"{encode_rate / 1e3:.0f}k tokens/s"],
        ["pipeline (train, after warm-up)", f"{rate / 1e3:.0f}k tokens/s"],
        ["padding", f"{100 * padding / tokens:.2f}%"],
        ["first batch / restore + first batch", f"{first_batch:.2f}s / {restore:.2f}s"],
        [f"headroom over {args.consumer_tokens_per_s / 1e3:.0f}k tokens/s", f"{headroom:.0f}x"],
    ]))
    save("data_pipeline", record)


if __name__ == "__main__":
    main()
