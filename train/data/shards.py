"""Token shards: the on-disk corpus `python -m train.data.prepare` writes and training reads by
random access (`train.data.source=DIR`), Megatron / nanoGPT style: flat token arrays memory-mapped
by numpy, an index of record offsets next to them, nothing decoded per record.

    DIR/manifest.json                      what was prepared from what (train/data/prepare.py)
    DIR/shards/{split}-{unit}.tokens       token ids, little-endian uint16 (vocabularies of up to
                                           65,536 ids) or uint32
    DIR/shards/{split}-{unit}.index        int64 [records, 2]: (end offset in tokens, length of
                                           the record's metadata prefix M)
    DIR/shards/{split}-{unit}.mask         chat shards only: uint8 per token, 1 on the assistant
                                           turns (train.loss_mask=assistant, train/data/chat.py)

A record is one document, or one piece of a long text file, encoded as the pipeline's encoder
does (train/data/encoder.py): [M; x; <|endoftext|>] with M kept, so `train.data.meta_tokens=false`
drops it at read time. Every file's size and sha256 are in the manifest (train/data/manifest.py):
a missing or truncated shard is refused when a run opens the directory (one stat per file, no
read of the corpus), an index that does not end where its tokens do when the shard is first
mapped, and a record whose offsets or token ids are out of range when it is read;
`python -m train.data.prepare --verify DIR` re-hashes every file.
"""

from __future__ import annotations

import collections
import hashlib
import mmap
import os
import resource
from pathlib import Path

import numpy as np

SHARDS = "shards"
INDEX_DTYPE = np.dtype("<i8")
FLUSH_TOKENS = 1 << 20  # a writer buffers this many tokens before writing


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_files(stem: str, mask: bool) -> dict[str, str]:
    return {kind: f"{stem}.{kind}" for kind in ("tokens", "index", *(("mask",) if mask else ()))}


class ShardWriter:
    """Appends records to one shard (three files), writing every FLUSH_TOKENS tokens and hashing
    on the way; files appear under their final names only when `close` succeeds, and not at all
    for a shard without records."""

    def __init__(self, root: Path, stem: str, dtype: np.dtype, with_mask: bool):
        self.root, self.stem, self.dtype = Path(root), stem, np.dtype(dtype)
        self.names = shard_files(stem, with_mask)
        self.files, self.digests = {}, {k: hashlib.sha256() for k in self.names}
        self.pending = {k: [] for k in self.names}
        self.records = self.documents = self.tokens = self.buffered = 0

    def add(self, tokens: np.ndarray, meta_len: int, mask: np.ndarray | None,
            starts: bool = True) -> None:
        self.tokens += len(tokens)
        self.pending["tokens"].append(np.asarray(tokens, self.dtype))
        self.pending["index"].append(np.array([[self.tokens, meta_len]], INDEX_DTYPE))
        if "mask" in self.names:
            self.pending["mask"].append(np.asarray(mask, np.uint8))
        self.records += 1
        self.documents += starts
        self.buffered += len(tokens)
        if self.buffered >= FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        for kind, arrays in self.pending.items():
            if not arrays:
                continue
            if kind not in self.files:
                self.files[kind] = open(self._partial(kind), "wb")
            data = np.concatenate(arrays).tobytes()
            self.digests[kind].update(data)
            self.files[kind].write(data)
            arrays.clear()
        self.buffered = 0

    def _partial(self, kind: str) -> Path:
        return self.root / (self.names[kind] + ".partial")

    def close(self) -> dict | None:
        """The shard's manifest entry (None if it holds no record)."""
        if not self.records:
            return None
        self._flush()
        for kind, f in self.files.items():
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(self._partial(kind), self.root / self.names[kind])
        return {"stem": self.stem, "records": self.records, "documents": self.documents,
                "tokens": self.tokens, "mask": "mask" in self.names,
                "sha256": {k: d.hexdigest() for k, d in self.digests.items()}}


def expected_bytes(shard: dict, dtype: np.dtype) -> dict[str, int]:
    sizes = {"tokens": shard["tokens"] * dtype.itemsize,
             "index": shard["records"] * 2 * INDEX_DTYPE.itemsize}
    if shard["mask"]:
        sizes["mask"] = shard["tokens"]
    return sizes


def _fix(root: Path) -> str:
    return f"re-run `python -m train.data.prepare` for {root}"


def check_shards(root: Path, shards: list[dict], dtype: np.dtype) -> None:
    """One-line ValueError for a missing or wrongly sized shard file: one stat per file, no
    file opened (an index's contents are checked when its shard is first mapped)."""
    for shard in shards:
        names = shard_files(shard["stem"], shard["mask"])
        for kind, size in expected_bytes(shard, dtype).items():
            path = os.path.join(root, names[kind])  # not pathlib: ~3x faster on 10^5 files
            try:
                actual = os.stat(path).st_size
            except OSError:
                raise ValueError(f"{path}: shard file missing; {_fix(root)}") from None
            if actual != size:
                raise ValueError(f"{path}: corrupt shard ({actual} bytes, the manifest says "
                                 f"{size}); {_fix(root)}")


def verify_shards(root: Path, shards: list[dict]) -> list[str]:
    """Files whose sha256 differs from the manifest's (reads every shard)."""
    bad = []
    for shard in shards:
        for kind, name in shard_files(shard["stem"], shard["mask"]).items():
            digest = hashlib.sha256()
            with open(Path(root) / name, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
            if digest.hexdigest() != shard["sha256"][kind]:
                bad.append(name)
    return bad


def open_files_budget() -> int:
    """Shards a reader keeps mapped (three descriptors each): the soft limit on open files,
    raised to the hard one, less a reserve for everything else."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    limit = 1 << 20 if soft == resource.RLIM_INFINITY else soft
    return max(4, (limit - 256) // 3)


def map_file(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """The file's `count` items as a read-only array (a plain ndarray: indexing it skips
    np.memmap's per-slice overhead), advised for random access: records are read at random, and
    the kernel's default readahead fetched ~6x the bytes read (200 batches from a 33 MB shard:
    +22 MB of mapped file pages, +3.6 MB advised). ValueError (one line) if the file is missing
    or not `count` items long."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != count * dtype.itemsize:
                raise ValueError(f"{path}: corrupt shard ({size} bytes, the manifest says "
                                 f"{count * dtype.itemsize})")
            if not size:
                return np.zeros(0, dtype)
            memory = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError:
        raise ValueError(f"{path}: shard file missing") from None
    if hasattr(mmap, "MADV_RANDOM"):  # not on every platform
        memory.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(memory, dtype)


class ShardSplit:
    """The records of one split of a prepared directory by global index 0..len-1 (shard order,
    as prepared). The manifest's shard entries are kept as a few numbers each; a shard is
    memory-mapped on first use (its files checked against its entry then), the least recently
    used unmapped beyond the open-files budget; pickles without its maps (grain worker
    processes). `vocab_size`: a record holding an id at or above it is refused by name."""

    def __init__(self, root: Path, shards: list[dict], dtype: np.dtype,
                 vocab_size: int | None = None):
        self.root, self.dtype, self.vocab_size = Path(root), np.dtype(dtype), vocab_size
        self.stems = [s["stem"] for s in shards]
        self.first = np.cumsum([0] + [s["records"] for s in shards])  # first index per shard
        self.tokens = np.array([s["tokens"] for s in shards], np.int64)
        self.masks = np.array([s["mask"] for s in shards], np.bool_)
        self._maps: collections.OrderedDict = collections.OrderedDict()
        self._budget = 0

    def __len__(self) -> int:
        return int(self.first[-1])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": collections.OrderedDict(), "_budget": 0}

    def _map(self, shard: int) -> dict:
        if shard in self._maps:
            self._maps.move_to_end(shard)
            return self._maps[shard]
        if not self._budget:
            self._budget = open_files_budget()
        while len(self._maps) >= self._budget:
            self._maps.popitem(last=False)
        names = shard_files(self.stems[shard], bool(self.masks[shard]))
        dtypes = {"tokens": self.dtype, "index": INDEX_DTYPE, "mask": np.dtype(np.uint8)}
        tokens, records = int(self.tokens[shard]), int(self.first[shard + 1] - self.first[shard])
        counts = {"tokens": tokens, "index": 2 * records, "mask": tokens}
        try:
            maps = {kind: map_file(self.root / name, dtypes[kind], counts[kind])
                    for kind, name in names.items()}
        except ValueError as err:
            raise ValueError(f"{err}; {_fix(self.root)}") from None
        maps["index"] = maps["index"].reshape(-1, 2)
        if maps["index"][-1, 0] != tokens:
            raise ValueError(f"{self.root / names['index']}: corrupt index (ends at token "
                             f"{maps['index'][-1, 0]}, the shard holds {tokens}); "
                             f"{_fix(self.root)}")
        self._maps[shard] = maps
        return maps

    def record(self, index: int) -> tuple[np.ndarray, int, np.ndarray | None]:
        """(tokens, metadata-prefix length, assistant mask or None) of record `index`."""
        shard = int(np.searchsorted(self.first, index, side="right")) - 1
        local = index - int(self.first[shard])
        maps = self._map(shard)
        end, meta_len = maps["index"][local].tolist()
        start = int(maps["index"][local - 1, 0]) if local else 0
        tokens = maps["tokens"][start:end]
        # Cheap checks of what the shard's bytes claim (a few microseconds a record): damage
        # of the same size is otherwise found only by --verify, which reads everything.
        damaged = (f"{self.root / self.stems[shard]}: record {local}" if not (
            0 <= start <= end <= len(maps["tokens"]) and 0 <= meta_len <= end - start)
            else None)
        if damaged is None and self.vocab_size is not None and len(tokens) \
                and tokens.max() >= self.vocab_size:
            damaged = (f"{self.root / self.stems[shard]}.tokens: record {local} holds token id "
                       f"{tokens.max()}, outside the tokenizer's {self.vocab_size} ids")
        if damaged is not None:
            raise ValueError(f"{damaged}; the shard is damaged: check the directory with "
                             f"`python -m train.data.prepare --verify {self.root}`")
        mask = maps["mask"][start:end] if "mask" in maps else None
        return tokens, meta_len, mask


class ReadExample:
    """Record index -> training example {tokens, meta_mask, loss_mask} (the encoder's output for
    the same document): the metadata prefix dropped unless `meta_tokens`, a chat's assistant
    mask as its loss mask if `assistant_only`."""

    def __init__(self, split: ShardSplit, meta_tokens: bool, assistant_only: bool):
        self.split, self.meta_tokens, self.assistant_only = split, meta_tokens, assistant_only

    def __call__(self, index: int) -> dict:
        tokens, meta_len, mask = self.split.record(index)
        skip = 0 if self.meta_tokens else meta_len
        tokens = np.asarray(tokens[skip:], np.int32)
        meta_mask = np.zeros(len(tokens), np.bool_)
        meta_mask[:meta_len - skip] = True
        if mask is not None and self.assistant_only:
            loss_mask = np.asarray(mask[skip:], np.bool_)
        else:
            loss_mask = np.ones(len(tokens), np.bool_)
        return {"tokens": tokens, "meta_mask": meta_mask, "loss_mask": loss_mask}
