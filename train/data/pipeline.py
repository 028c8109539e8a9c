"""The grain input pipeline: records -> examples (tokens + metadata prefix) -> packed rows ->
batches. Records are documents in memory or token-shard records read by index
(train/data/sources.py); a mixture packs each source on its own and interleaves the rows.

    data = make_dataset(cfg.data, tokenizer, seq_len=256, batch_size=8, split="train", seed=0,
                        shard_index=jax.process_index(), shard_count=jax.process_count())
    batch = next(data)   # {tokens, segment_ids, positions, meta_mask, loss_mask}: numpy
                         # [batch, seq_len]
    state = data.get_state()   # JSON-serialisable; a fresh iterator + set_state(state) continues
                               # the stream exactly
    data.mixture_shares()      # a mixture's realised share of the rows read, by source

`train`: this host's records, reshuffled every epoch (grain's index shuffle, seed + epoch: no
permutation is ever held in memory), repeated forever, with the packed rows shuffled again in
windows of ~256k tokens so a batch mixes many documents. `heldout`: deterministic order, one
pass; a short last batch is completed with padding rows (segment 0), so every batch has the same
shape. Hosts get disjoint slices of the records (every `shard_count`-th from `shard_index`),
before any shuffling, and read only those.

Raw documents are tokenised lazily, a few ahead in one background thread (the stdlib corpus
encodes at ~0.9M tokens/s on one core, far above what a training step consumes), so start-up
is instant and nothing is cached on disk; prepared shards are only read. `train.data.num_workers
> 0` reads and tokenises in grain worker processes (train/data/example_stream.py): the stream and
its checkpointed position are the same for any number of workers, so a resumed run may change
it.
"""

from __future__ import annotations

import functools
import json

import grain
import numpy as np

from model.tokenizers.text import TextTokenizer
from train.data.config import DataConfig
from train.data.chat import trains_assistant_only
from train.data.example_stream import ExampleStream
from train.data.packing import pack, pad_batch
from train.data.shuffle import WindowShuffle
from train.data.sources import SPLITS, TrainingData, open_data

SHUFFLE_WINDOW_TOKENS = 1 << 18  # packed rows are shuffled within windows of this many tokens
MIXTURE = "mixture"  # a mixture's rows carry their source's index under this key
# What grain appends to the message of an exception raised in its pipeline (its traceback note).
GRAIN_NOTE = "\n--------------------\n"


def host_records(records: grain.MapDataset, split: str, shard_index: int = 0,
                 shard_count: int = 1) -> grain.MapDataset:
    """This host's records of one split: every `shard_count`-th from `shard_index`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} outside [0, shard_count={shard_count})")
    if not len(records):
        raise ValueError(f"train.data: the {split} split is empty; add documents or change "
                         "train.data.heldout_fraction")
    mine = records[shard_index::shard_count]
    if not len(mine):
        raise ValueError(f"train.data: the {split} split has {len(records)} record(s), too few "
                         f"for {shard_count} hosts")
    return mine


class TagSource:
    """Row -> the row with its mixture source's index (picklable, for worker processes)."""

    def __init__(self, index: int):
        self.index = index

    def __call__(self, row: dict) -> dict:
        return {**row, MIXTURE: np.int32(self.index)}


def build_dataset(data_cfg: DataConfig, tokenizer: TextTokenizer, *, seq_len: int,
                  batch_size: int, split: str, seed: int = 0, shard_index: int = 0,
                  shard_count: int = 1, data: TrainingData | None = None,
                  loss_mask: str = "auto") -> grain.IterDataset:
    """The pipeline as a grain IterDataset (see make_dataset). `data`: the run's opened data
    (train/data/sources.py), else opened from `data_cfg`."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    data = open_data(data_cfg, tokenizer) if data is None else data
    # Decided on all the data, so that every split and host reads the same way.
    assistant_only = trains_assistant_only(loss_mask, data.has_chats)
    train = split == "train"
    streams = {}
    for index, (name, source) in enumerate(data.sources.items()):
        records = host_records(source.split_records(split, data_cfg.heldout_fraction), split,
                               shard_index, shard_count)
        if train:
            # repeat() after shuffle: grain reshuffles every epoch (seed + epoch)
            shuffled = records.shuffle(seed=(seed + index) % 2**32)
            records = (shuffled if data_cfg.shuffle else records).repeat()
        example = source.example_fn(split, tokenizer, data_cfg.meta_tokens, assistant_only)
        examples = ExampleStream(records.map(example), source.read_options,
                                 data_cfg.num_workers)
        rows = pack(examples, seq_len)
        streams[name] = rows if data.weights is None else rows.map(TagSource(index))
    if data.weights is None:
        (rows,) = streams.values()
    else:  # rows of seq_len tokens each: the weights are shares of tokens
        rows = grain.IterDataset.mix(streams, data.weights)
    if train and data_cfg.shuffle:
        window = max(SHUFFLE_WINDOW_TOKENS // seq_len, 2 * batch_size)
        rows = WindowShuffle(rows, window_size=window, seed=seed % 2**32)
    batches = rows.batch(batch_size, drop_remainder=train)
    if not train:
        batches = batches.map(functools.partial(pad_batch, batch_size=batch_size))
    return batches


class DataIterator:
    """A grain iterator whose state also records the pipeline it belongs to, so restoring a
    state into a different pipeline (other seq_len, batch, seed, shards) fails with a one-line
    error instead of silently yielding another stream (the worker count may change)."""

    def __init__(self, dataset: grain.IterDataset, pipeline: dict,
                 mixture: list[str] | None = None):
        self.pipeline = pipeline
        self._iterator = iter(dataset)
        self.mixture = mixture or []
        self.rows = [0] * len(self.mixture)  # rows read so far, by mixture source
        self._peeked = None  # (state before it, batch) of a batch `peek` read

    def __iter__(self):
        return self

    def peek(self) -> dict:
        """The next batch, read now and returned again by the next `next()`: a run reads its
        first batch, and so meets bad data, before anything compiles."""
        if self._peeked is None:
            state = self.get_state()
            self._peeked = (state, next(self))
        return self._peeked[1]

    def __next__(self) -> dict:
        if self._peeked is not None:
            batch, self._peeked = self._peeked[1], None
            return batch
        try:
            batch = next(self._iterator)
        except ValueError as err:  # a record that could not be read, named where it was read
            raise ValueError(str(err).split(GRAIN_NOTE)[0]) from None
        sources = batch.pop(MIXTURE, None)
        if sources is not None:
            counts = np.bincount(sources, minlength=len(self.mixture))
            self.rows = [int(r + c) for r, c in zip(self.rows, counts)]
        return batch

    def mixture_shares(self) -> dict[str, float]:
        """{source name: share of the rows (and so of the tokens) read so far}, over the whole
        stream, resumes included; {} without a mixture or before the first batch."""
        total = sum(self.rows)
        return {n: r / total for n, r in zip(self.mixture, self.rows)} if total else {}

    def get_state(self) -> dict:
        """JSON-serialisable (plain dicts, lists, ints, strings)."""
        if self._peeked is not None:
            return self._peeked[0]
        return json.loads(json.dumps({"pipeline": self.pipeline, "mixture_rows": self.rows,
                                      "grain": self._iterator.get_state()}))

    def set_state(self, state: dict) -> None:
        saved = dict(state.get("pipeline", {})) if isinstance(state, dict) else {}
        if saved.pop("num_workers", 0):  # whose grain state the worker count shaped
            raise ValueError("data state saved by an older stepjax with train.data.num_workers="
                             f"{state['pipeline']['num_workers']}: its position cannot be "
                             "restored; resume with that stepjax, or start a new --workdir")
        changed = sorted(k for k in self.pipeline.keys() | saved.keys()
                         if saved.get(k) != self.pipeline.get(k))
        if changed:
            raise ValueError("data state belongs to another pipeline: "
                             + ", ".join(f"{k} {saved.get(k)!r} -> {self.pipeline.get(k)!r}"
                                         for k in changed))
        self._peeked = None
        self._iterator.set_state(_restore_tuples(state["grain"]))
        self.rows = list(state.get("mixture_rows", self.rows))


def _restore_tuples(state):
    """grain's ConcatThenSplit compares its `remainder_slices` with the tuple (-1, -1); JSON
    turned them into lists, which would silently break the resumed stream."""
    if isinstance(state, list):
        return [_restore_tuples(v) for v in state]
    if not isinstance(state, dict):
        return state
    return {k: ({f: tuple(sl) for f, sl in v.items()} if k == "remainder_slices"
                else _restore_tuples(v)) for k, v in state.items()}


def make_dataset(data_cfg: DataConfig, tokenizer: TextTokenizer, *, seq_len: int,
                 batch_size: int, split: str, seed: int = 0, shard_index: int = 0,
                 shard_count: int = 1, data: TrainingData | None = None,
                 loss_mask: str = "auto") -> DataIterator:
    """Iterator of numpy batches {tokens, segment_ids, positions (int32), meta_mask, loss_mask
    (bool)}, each [batch_size, seq_len]; `get_state()` / `set_state()` checkpoint its
    position. `data`: the opened data (train/data/sources.py), else opened from `data_cfg`.
    `loss_mask`: `train.loss_mask` (train/data/chat.py)."""
    data = open_data(data_cfg, tokenizer) if data is None else data
    dataset = build_dataset(data_cfg, tokenizer, seq_len=seq_len, batch_size=batch_size,
                            split=split, seed=seed, shard_index=shard_index,
                            shard_count=shard_count, data=data, loss_mask=loss_mask)
    pipeline = {"split": split, "seq_len": seq_len, "batch_size": batch_size, "seed": seed,
                "shard_index": shard_index, "shard_count": shard_count}
    return DataIterator(dataset, pipeline, list(data.sources) if data.weights else None)
