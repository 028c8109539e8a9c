"""What a run trains on, opened once before anything compiles: documents read into memory
(`RawSource`: stdlib, procedural tasks, .txt/.jsonl files) or a prepared directory of token
shards (`PreparedSource`, train/data/shards.py), alone (`train.data.source`) or as a weighted
mixture of several (`train.data.mixture`).

    data = open_data(cfg.data, tokenizer)     # raw documents read once, or manifests only
    check_data(data, cfg.data, loss_mask="auto", heldout=True, shard_count=2)
    data.fingerprint                          # the run record's (train/run_record.py)
    records = source.split_records("train", cfg.data.heldout_fraction)   # grain MapDataset
    example = source.example_fn("train", tokenizer, meta_tokens=True, assistant_only=False)

Both kinds yield the same examples for the same documents in the same order, so a prepared
directory trains exactly as its raw files would (tests/train/test_data_shards.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Protocol

import grain
import numpy as np

from model.interop.workdir_record import describe_tokenizer, tokenizer_identity
from model.tokenizers.chat import chat_tokenizer_for
from model.tokenizers.text import TextTokenizer
from train.data.config import DataConfig
from train.data.chat import chat_example, templates_sha256, trains_assistant_only
from train.data.corpus import load_corpus, source_entries
from train.data.documents import split_documents
from train.data.encoder import DocumentEncoder
from train.data.manifest import (
    MANIFEST,
    SPLITS,
    is_prepared,
    load_manifest,
    prepared_fingerprint,
)
from train.data.shards import ReadExample, ShardSplit, check_shards, token_dtype


class Source(Protocol):
    name: str  # as the config names it: the source string, or the mixture's key
    has_chats: bool
    fingerprint: dict
    read_options: grain.ReadOptions  # how the pipeline reads records into examples

    def split_sizes(self, heldout_fraction: float) -> tuple[int, int]: ...
    def split_records(self, split: str, heldout_fraction: float) -> grain.MapDataset: ...
    def example_fn(self, split: str, tokenizer: TextTokenizer, meta_tokens: bool,
                   assistant_only: bool) -> Callable: ...
    def check_chats(self, tokenizer: TextTokenizer) -> None: ...
    def split_problem(self, heldout_fraction: float, heldout: bool,
                      shard_count: int) -> str | None: ...


class RawSource:
    """Documents read into memory (train/data/corpus.py), encoded as the pipeline reads them."""

    # One background thread tokenises a few documents ahead (the tokenizer releases the GIL),
    # overlapping the train step.
    read_options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=8)

    def __init__(self, name: str):
        self.name = name
        corpus = load_corpus(name)
        self.documents, self.fingerprint = corpus.documents, corpus.fingerprint
        self.has_chats = any(d.chat is not None for d in self.documents)

    def split_sizes(self, heldout_fraction: float) -> tuple[int, int]:
        train, heldout = split_documents(self.documents, heldout_fraction)
        return len(train), len(heldout)

    def split_records(self, split: str, heldout_fraction: float) -> grain.MapDataset:
        return grain.MapDataset.source(
            split_documents(self.documents, heldout_fraction)[SPLITS.index(split)])

    def example_fn(self, split, tokenizer, meta_tokens, assistant_only) -> Callable:
        chat = chat_tokenizer_for(tokenizer) if self.has_chats else None
        return DocumentEncoder(tokenizer, meta_tokens, chat, assistant_only)

    def check_chats(self, tokenizer: TextTokenizer) -> None:
        """A chat template that cannot render this data fails now, not in the data thread."""
        first = next((d for d in self.documents if d.chat is not None), None)
        if first is not None:
            chat_example(chat_tokenizer_for(tokenizer), first, assistant_only=False)

    def split_problem(self, heldout_fraction, heldout, shard_count) -> str | None:
        train, held = self.split_sizes(heldout_fraction)
        where = (f"{train + held} document(s) with train.data.heldout_fraction="
                 f"{heldout_fraction}")
        if train < shard_count:
            return (f"{where} leave {train} for training, too few for {shard_count} host(s); "
                    "add documents or lower train.data.heldout_fraction")
        if heldout and not held:
            return (f"{where} leave none held out for evaluation; raise "
                    "train.data.heldout_fraction, add documents or set train.eval_every=0")
        return None


class PreparedSource:
    """A directory of `python -m train.data.prepare`: its manifest is read and checked
    (train/data/manifest.py) and its shard files checked by size; records are read by index,
    per host, when the pipeline asks for them. What it holds does not grow with the corpus
    beyond a few numbers per shard (the manifest's entries are not kept)."""

    # Reading a record is a few microseconds of Python: a reading thread would only contend
    # for the GIL with the packing (measured: 2.3M tokens/s with one, 3.6M without).
    read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)

    def __init__(self, name: str, tokenizer: TextTokenizer, heldout_fraction: float):
        self.name, self.root = name, Path(name)
        manifest, sha256 = load_manifest(self.root)
        recorded = manifest["tokenizer"]
        if recorded["sha256"] != tokenizer.fingerprint():
            raise ValueError(f"prepared with tokenizer {describe_tokenizer(recorded)}, not the "
                             f"run's {describe_tokenizer(tokenizer_identity(tokenizer))}; set "
                             f"train.data.tokenizer={recorded['name']} or prepare the corpus "
                             "again with --tokenizer")
        vocab = tokenizer.get_vocab_size()
        self.dtype = np.dtype(manifest["dtype"])
        if self.dtype != token_dtype(vocab):
            raise ValueError(f"{self.root / MANIFEST}: dtype: {manifest['dtype']!r} does "
                             f"not hold the tokenizer's {vocab} ids as prepare writes them "
                             f"({token_dtype(vocab).str!r}); prepare the corpus again")
        self.has_chats = bool(manifest["chats"])
        templates = manifest["chat_templates_sha256"]
        if self.has_chats and templates != templates_sha256(chat_tokenizer_for(tokenizer)):
            raise ValueError("its chats were rendered with another chat template than the "
                             "run's tokenizer has; prepare the corpus again")
        if manifest["heldout_fraction"] != heldout_fraction:
            raise ValueError(f"prepared with --heldout-fraction {manifest['heldout_fraction']}; "
                             f"set train.data.heldout_fraction={manifest['heldout_fraction']} "
                             "or prepare the corpus again")
        for split in SPLITS:
            check_shards(self.root, manifest["splits"][split]["shards"], self.dtype)
        self.splits = {s: ShardSplit(self.root, manifest["splits"][s]["shards"], self.dtype,
                                     vocab) for s in SPLITS}
        self.fingerprint = prepared_fingerprint(self.root, manifest, sha256)

    def split_sizes(self, heldout_fraction: float) -> tuple[int, int]:
        return tuple(len(self.splits[s]) for s in SPLITS)

    def split_records(self, split: str, heldout_fraction: float) -> grain.MapDataset:
        return grain.MapDataset.range(len(self.splits[split]))

    def example_fn(self, split, tokenizer, meta_tokens, assistant_only) -> Callable:
        return ReadExample(self.splits[split], meta_tokens, assistant_only)

    def check_chats(self, tokenizer: TextTokenizer) -> None:
        """Its chats were rendered when it was prepared, with the template checked on opening."""

    def split_problem(self, heldout_fraction, heldout, shard_count) -> str | None:
        train, held = self.split_sizes(heldout_fraction)
        if train < shard_count:
            return (f"its train split has {train} record(s), too few for {shard_count} host(s)")
        if heldout and not held:
            return ("its held-out split is empty; prepare it with a larger --heldout-fraction "
                    "or set train.eval_every=0")
        return None


def open_source(entry_list: str, tokenizer: TextTokenizer, heldout_fraction: float,
                field: str = "source") -> Source:
    """A `train.data.source` value (or a mixture's key: `field`): one prepared directory, or
    raw entries."""
    entries = source_entries(entry_list)
    prepared = [e for e in entries if is_prepared(e)]
    where = f"train.data.{field} {entry_list!r}"
    if prepared and len(entries) > 1:
        raise ValueError(f"{where}: a prepared directory ({prepared[0]}) is a source of its "
                         "own; combine several with train.data.mixture")
    if not prepared:
        return RawSource(entry_list)
    try:
        return PreparedSource(prepared[0], tokenizer, heldout_fraction)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def mixture_names(keys: list[str]) -> list[str]:
    """Short names of mixture sources for metrics: a path's last component where unique."""
    short = [Path(k.rstrip("/")).name or k for k in keys]
    return [s if short.count(s) == 1 else k for s, k in zip(short, keys)]


@dataclasses.dataclass
class TrainingData:
    """The opened sources by name, and their weights (None for a single source)."""

    sources: dict[str, Source]
    weights: dict[str, float] | None = None

    @property
    def has_chats(self) -> bool:
        return any(s.has_chats for s in self.sources.values())

    @property
    def renders_chats(self) -> bool:
        """Whether chats are rendered while reading (raw chat data): the run's chat template is
        then part of the data. A prepared directory's chats were rendered when it was made."""
        return any(isinstance(s, RawSource) and s.has_chats for s in self.sources.values())

    @property
    def fingerprint(self) -> dict:
        return {k: v for s in self.sources.values() for k, v in s.fingerprint.items()}


def open_data(data_cfg: DataConfig, tokenizer: TextTokenizer) -> TrainingData:
    """Opens `train.data.mixture` (each key a source) or else `train.data.source`; raises a
    one-line ValueError for unreadable data or a prepared directory that does not fit the run."""
    if not data_cfg.mixture:
        source = open_source(data_cfg.source, tokenizer, data_cfg.heldout_fraction)
        return TrainingData({data_cfg.source: source})
    keys = list(data_cfg.mixture)
    sources, weights = {}, {}
    for key, name in zip(keys, mixture_names(keys)):
        sources[name] = open_source(key, tokenizer, data_cfg.heldout_fraction, "mixture")
        weights[name] = float(data_cfg.mixture[key])
    return TrainingData(sources, weights)


def check_data(data: TrainingData, data_cfg: DataConfig, tokenizer: TextTokenizer, *,
               loss_mask: str, heldout: bool, shard_count: int = 1) -> None:
    """Raises a one-line ValueError, naming the source and the fields to change, if a split the
    run reads is empty (the train split: a record for each of `shard_count` hosts; the held-out
    split if `heldout`, i.e. the run evaluates), `loss_mask` does not fit the data or the chat
    template cannot render it. Either stream yields full batches from a single record, so a
    non-empty split is enough."""
    trains_assistant_only(loss_mask, data.has_chats)
    keys = dict(zip(data.sources, data_cfg.mixture or [data_cfg.source]))
    for name, source in data.sources.items():
        source.check_chats(tokenizer)
        problem = source.split_problem(data_cfg.heldout_fraction, heldout, shard_count)
        if problem:
            field = "mixture" if data_cfg.mixture else "source"
            raise ValueError(f"train.data.{field} {keys[name]!r}: {problem}")
