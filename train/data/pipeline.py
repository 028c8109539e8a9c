"""The grain input pipeline: documents -> tokens (+ metadata prefix) -> packed rows -> batches.

    data = make_dataset(cfg.data, tokenizer, seq_len=256, batch_size=8, split="train", seed=0,
                        shard_index=jax.process_index(), shard_count=jax.process_count())
    batch = next(data)   # {tokens, segment_ids, positions, meta_mask, loss_mask}: numpy
                         # [batch, seq_len]
    state = data.get_state()   # JSON-serialisable; a fresh iterator + set_state(state) continues
                               # the stream exactly

`train`: this host's documents, reshuffled every epoch (seed + epoch), repeated forever, with the
packed rows shuffled again in windows of ~256k tokens so a batch mixes many documents.
`heldout`: deterministic order, one pass; a short last batch is completed with padding rows
(segment 0), so every batch has the same shape. Hosts get disjoint slices of the documents
(every `shard_count`-th document from `shard_index`), before any shuffling.

Documents are tokenised lazily, a few ahead in one background thread (the stdlib corpus
encodes at ~0.9M tokens/s on one core, far above what a training step consumes), so start-up
is instant and nothing is cached on disk. `train.data.num_workers > 0` moves the pipeline into
grain worker processes; with two or more workers the stream differs (documents are dealt out to
workers), so a run must resume with the same value.
"""

from __future__ import annotations

import functools
import json

import grain
import numpy as np
from absl import flags
from grain.experimental import WindowShuffleIterDataset

from model.tokenizers.chat import ChatTokenizer, chat_tokenizer_for
from model.tokenizers.text import TextTokenizer
from train.config import DataConfig
from train.data.chat import chat_example, trains_assistant_only
from train.data.corpus import load_documents, meta_string
from train.data.documents import Document, split_documents
from train.data.packing import document_example, pack, pad_batch

SPLITS = ("train", "heldout")
SHUFFLE_WINDOW_TOKENS = 1 << 18  # packed rows are shuffled within windows of this many tokens


def split_shard(docs: list[Document], heldout_fraction: float, split: str,
                shard_index: int = 0, shard_count: int = 1) -> list[Document]:
    """This host's documents of one split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} outside [0, shard_count={shard_count})")
    chosen = split_documents(docs, heldout_fraction)[SPLITS.index(split)]
    if not chosen:
        raise ValueError(f"train.data: the {split} split of {len(docs)} document(s) is empty; "
                         "add documents or change train.data.heldout_fraction")
    shard = chosen[shard_index::shard_count]
    if not shard:
        raise ValueError(f"train.data: the {split} split has {len(chosen)} document(s), too few "
                         f"for {shard_count} hosts")
    return shard


def check_splits(data_cfg: DataConfig, documents: list[Document], *, heldout: bool,
                 shard_count: int = 1) -> None:
    """Raises ValueError, naming the source and the fields to change, if a split the run reads
    is empty: the train split (a document for each of `shard_count` hosts) and, if `heldout`
    (the run evaluates), the held-out split. Either stream yields full batches from a single
    document (train repeats, held-out pads), so a non-empty split is enough."""
    train, held = split_documents(documents, data_cfg.heldout_fraction)
    where = (f"train.data.source {data_cfg.source!r}: {len(documents)} document(s) with "
             f"train.data.heldout_fraction={data_cfg.heldout_fraction}")
    if len(train) < shard_count:
        raise ValueError(f"{where} leave {len(train)} for training, too few for {shard_count} "
                         "host(s); add documents or lower train.data.heldout_fraction")
    if heldout and not held:
        raise ValueError(f"{where} leave none held out for evaluation; raise "
                         "train.data.heldout_fraction, add documents or set train.eval_every=0")


class DocumentEncoder:
    """Document -> {tokens, meta_mask, loss_mask} example (a picklable callable, for worker
    processes). Chats are rendered by `chat` (train/data/chat.py), trained on their assistant
    turns only if `assistant_only`."""

    def __init__(self, tokenizer: TextTokenizer, meta_tokens: bool,
                 chat: ChatTokenizer | None = None, assistant_only: bool = False):
        self.tokenizer, self.meta_tokens = tokenizer, meta_tokens
        self.chat, self.assistant_only = chat, assistant_only

    def __call__(self, doc: Document) -> dict:
        if doc.chat is not None:
            return chat_example(self.chat, doc, self.assistant_only)
        tok = self.tokenizer
        meta = None
        if self.meta_tokens:
            meta = np.concatenate([[tok.meta_open_id], tok.encode(meta_string(doc.meta)),
                                   [tok.meta_close_id]]).astype(np.int32)
        return document_example(meta, tok.encode(doc.text), tok.eos_id)


def build_dataset(data_cfg: DataConfig, tokenizer: TextTokenizer, *, seq_len: int,
                  batch_size: int, split: str, seed: int = 0, shard_index: int = 0,
                  shard_count: int = 1, documents: list[Document] | None = None,
                  loss_mask: str = "auto") -> grain.IterDataset:
    """The pipeline as a grain IterDataset (see make_dataset). `documents` overrides
    `data_cfg.source` (already loaded documents)."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    docs = load_documents(data_cfg.source) if documents is None else documents
    # Decided on all the documents, so that every split and host reads the same way.
    encode = DocumentEncoder(
        tokenizer, data_cfg.meta_tokens,
        chat_tokenizer_for(tokenizer) if any(d.chat is not None for d in docs) else None,
        trains_assistant_only(loss_mask, docs))
    docs = split_shard(docs, data_cfg.heldout_fraction, split, shard_index, shard_count)
    train = split == "train"
    ds = grain.MapDataset.source(docs)
    if train:
        # repeat() after shuffle: grain reshuffles every epoch (seed + epoch)
        ds = (ds.shuffle(seed=seed % 2**32) if data_cfg.shuffle else ds).repeat()
    # One background thread tokenises a few documents ahead (overlapping the train step).
    examples = ds.map(encode).to_iter_dataset(
        grain.ReadOptions(num_threads=1, prefetch_buffer_size=8))
    rows = pack(examples, seq_len)
    if train and data_cfg.shuffle:
        window = max(SHUFFLE_WINDOW_TOKENS // seq_len, 2 * batch_size)
        rows = WindowShuffleIterDataset(rows, window_size=window, seed=seed % 2**32)
    batches = rows.batch(batch_size, drop_remainder=train)
    if not train:
        batches = batches.map(functools.partial(pad_batch, batch_size=batch_size))
    if data_cfg.num_workers > 0:
        # grain's worker processes read absl flags; parse them (to defaults) if nobody did.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        options = grain.MultiprocessingOptions(num_workers=data_cfg.num_workers)
        batches = batches.mp_prefetch(options)
    return batches


class DataIterator:
    """A grain iterator whose state also records the pipeline it belongs to, so restoring a
    state into a different pipeline (other seq_len, batch, seed, shards, workers) fails with a
    one-line error instead of silently yielding another stream."""

    def __init__(self, dataset: grain.IterDataset, pipeline: dict):
        self.pipeline = pipeline
        self._iterator = iter(dataset)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return next(self._iterator)

    def get_state(self) -> dict:
        """JSON-serialisable (plain dicts, lists, ints, strings)."""
        return json.loads(json.dumps({"pipeline": self.pipeline,
                                      "grain": self._iterator.get_state()}))

    def set_state(self, state: dict) -> None:
        saved = state.get("pipeline", {}) if isinstance(state, dict) else {}
        changed = sorted(k for k in self.pipeline.keys() | saved.keys()
                         if saved.get(k) != self.pipeline.get(k))
        if changed:
            raise ValueError("data state belongs to another pipeline: "
                             + ", ".join(f"{k} {saved.get(k)!r} -> {self.pipeline.get(k)!r}"
                                         for k in changed))
        self._iterator.set_state(_restore_tuples(state["grain"]))


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
                 shard_count: int = 1, documents: list[Document] | None = None,
                 loss_mask: str = "auto") -> DataIterator:
    """Iterator of numpy batches {tokens, segment_ids, positions (int32), meta_mask, loss_mask
    (bool)}, each [batch_size, seq_len]; `get_state()` / `set_state()` checkpoint its
    position. `loss_mask`: `train.loss_mask` (train/data/chat.py)."""
    dataset = build_dataset(data_cfg, tokenizer, seq_len=seq_len, batch_size=batch_size,
                            split=split, seed=seed, shard_index=shard_index,
                            shard_count=shard_count, documents=documents, loss_mask=loss_mask)
    pipeline = {"split": split, "seq_len": seq_len, "batch_size": batch_size, "seed": seed,
                "shard_index": shard_index, "shard_count": shard_count,
                "num_workers": data_cfg.num_workers}
    return DataIterator(dataset, pipeline)
