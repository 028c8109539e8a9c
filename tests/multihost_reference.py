"""The one-process reference of tests/train/test_multihost.py, run as a subprocess with 8 CPU
devices: `python -m train` whose train stream is the two processes' shard streams, each with half
the batch, concatenated row-wise (process 0's rows first), so that it sees the same global batches
as the 2-process run.

    python tests/multihost_reference.py TRAIN-ARGS...

Exits with the trainer's status; a misuse of the patched dataset raises with the values.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import train.loop  # noqa: E402
from train.data.pipeline import make_dataset  # noqa: E402


class TwoShards:
    """Batches of shard 0 and shard 1 (each `batch_size // 2` rows), concatenated row-wise."""

    def __init__(self, shards):
        self.shards = shards

    def __iter__(self):
        return self

    def __next__(self):
        parts = [next(s) for s in self.shards]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def peek(self):
        parts = [s.peek() for s in self.shards]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def get_state(self):
        return {"shards": [s.get_state() for s in self.shards]}

    def set_state(self, state):
        for s, st in zip(self.shards, state["shards"]):
            s.set_state(st)


def as_two_processes(data_cfg, tokenizer, *, batch_size, split, shard_index=0, shard_count=1,
                     **kwargs):
    if split != "train":  # held-out evaluation reads all documents in every process
        return make_dataset(data_cfg, tokenizer, batch_size=batch_size, split=split, **kwargs)
    if (shard_index, shard_count) != (0, 1):
        raise ValueError(f"the reference is one process reading one shard; the trainer asked "
                         f"for shard {shard_index} of {shard_count}")
    if batch_size % 2:
        raise ValueError(f"the global batch must split into two halves, got {batch_size} rows")
    return TwoShards([make_dataset(data_cfg, tokenizer, batch_size=batch_size // 2, split=split,
                                   shard_index=i, shard_count=2, **kwargs) for i in range(2)])


if __name__ == "__main__":
    train.loop.make_dataset = as_two_processes
    from train.__main__ import main

    sys.exit(main(sys.argv[1:]))
