"""Documents for training read into memory: the embedded stdlib corpus, the procedural tasks and
local `.txt` / `.jsonl` files (plain text, or chats rendered with the tokenizer's chat template:
train/data/chat.py). Corpora too large for memory are prepared into token shards instead
(`python -m train.data.prepare`, train/data/shards.py).

    corpus = load_corpus("stdlib")   # or "a.jsonl,books/*.txt", "arith,arith_multistep"
    corpus.documents, corpus.fingerprint                    # fingerprint: train/data/fingerprint.py
    train, heldout = split_documents(corpus.documents, 0.05)   # train.data.documents

A `Document` is its text plus human-readable metadata (report A.3: content type, language,
domain, source) and a stable `key` that decides its split. Every file is read once, in blocks
(train/data/readers.py), and hashed on the way for the data fingerprint. Loading is eager and
validated up front, so a bad input fails at start-up with one line naming the culprit, not
mid-run.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import sys
import sysconfig
from pathlib import Path
from typing import Mapping, Sequence

from train.data.arithmetic import arithmetic_documents
from train.data.documents import Document
from train.data.manifest import unfinished_preparation
from train.data.multistep import multistep_documents
from train.data.readers import META_FIELDS, read_file

SUFFIXES = (".txt", ".jsonl")  # what a training run reads directly
PREPARED_ONLY = (".parquet",)  # what only `python -m train.data.prepare` reads
# Directories of the standard library that are not "the library": third-party packages and the
# (large, repetitive) regression-test suites.
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                              "__pycache__"})
# Machine-generated codec tables (encodings/cp1252.py, ...): ~10% of the library's bytes, all
# hex literals; they would teach the model little and skew the tokenizer.
GENERATED_MARKER = "with gencodec.py"
# The procedural tasks' SFT documents (warm-start data for RL), by source name.
PROCEDURAL_SOURCES = {"arith": arithmetic_documents, "arith_multistep": multistep_documents}


def meta_string(meta: Mapping[str, str]) -> str:
    """The human-readable metadata M of report A.3, e.g. `type=Code lang=python source=json/x.py`.
    Values are single-lined so M never spans lines."""
    return " ".join(f"{k}={' '.join(str(meta[k]).split())}" for k in META_FIELDS if meta.get(k))


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents() -> list[Document]:
    """The running Python's standard-library `.py` sources (no tests, site-packages or generated
    codec tables), sorted by relative path: real code on every machine, no download."""
    root = stdlib_root()
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS]
        paths += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    docs = []
    for rel in sorted(p.relative_to(root).as_posix() for p in paths):
        text = (root / rel).read_bytes().decode("utf-8", errors="replace")
        if text.strip() and GENERATED_MARKER not in text[:300]:
            docs.append(Document(rel, text, {"type": "Code", "lang": "python", "source": rel}))
    if not docs:
        raise ValueError(f"train.data.source: no .py files found in the standard library at {root}")
    return docs


def source_entries(source: str) -> list[str]:
    """The comma-separated items of a `train.data.source`."""
    return [e.strip() for e in source.split(",") if e.strip()]


def resolve_files(entry: str, suffixes: Sequence[str] = SUFFIXES) -> list[tuple[Path, str]]:
    """One comma-separated item of `DataConfig.source`: a file, a directory (its files of
    `suffixes`, recursively) or a glob -> sorted (path, name) pairs, never empty. `name` is
    the path relative to the entry's base directory (the glob's fixed prefix, the directory, or
    the file's own directory), so splits and metadata do not depend on where the data lives."""
    kinds = "/".join(suffixes)
    if glob.has_magic(entry):
        base = Path(*(_prefix_parts(entry) or ["."]))
        files = sorted(Path(p) for p in glob.glob(entry, recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"train.data.source: glob {entry!r} matched no files")
    elif Path(entry).is_dir():
        base = Path(entry)
        files = sorted(p for p in base.rglob("*") if p.suffix in suffixes and p.is_file())
        if not files:
            problem = unfinished_preparation(base) or f"directory {entry!r} has no {kinds} files"
            raise ValueError(f"train.data.source: {problem}")
    elif Path(entry).is_file():
        base, files = Path(entry).parent, [Path(entry)]
    else:
        raise ValueError(f"train.data.source: {entry!r} does not exist")
    for path in files:
        if path.suffix in PREPARED_ONLY and path.suffix not in suffixes:
            raise ValueError(f"train.data.source: {str(path)!r}: {path.suffix} files are read by "
                             "`python -m train.data.prepare`; prepare the corpus and train from "
                             "the prepared directory")
        if path.suffix not in suffixes:
            raise ValueError(f"train.data.source: {str(path)!r} is not a {kinds} file")
    return [(path, path.relative_to(base).as_posix()) for path in files]


def _prefix_parts(pattern: str) -> list[str]:
    """Leading path components of a glob pattern that hold no wildcard."""
    parts = []
    for part in Path(pattern).parts:
        if glob.has_magic(part):
            break
        parts.append(part)
    return parts


def stdlib_identity() -> dict:
    """The stdlib corpus is fixed by the Python version it comes from."""
    return {"python": sys.version.split()[0], "root": str(stdlib_root())}


def procedural_identity(docs: list[Document]) -> dict:
    digest = hashlib.sha256("\n".join(d.text for d in docs).encode()).hexdigest()
    return {"documents": len(docs), "sha256": digest}


@dataclasses.dataclass(frozen=True)
class Corpus:
    documents: list[Document]
    # {entry or file path: identity}: train/data/fingerprint.py compares two of them
    fingerprint: dict[str, dict]


def load_corpus(source: str) -> Corpus:
    """`source`: `stdlib`, `arith` / `arith_multistep` (the procedural tasks of
    `train.data.arithmetic` / `train.data.multistep`: SFT warm-start data for RL) and/or
    comma-separated `.txt`/`.jsonl` paths, directories, globs. Each file is read once; its
    sha256 is taken on the way."""
    entries = source_entries(source)
    if not entries:
        raise ValueError("train.data.source: empty; use 'stdlib' or paths/globs of .txt/.jsonl")
    docs, fingerprint, seen = [], {}, set()
    for entry in entries:
        if entry == "stdlib":
            docs += stdlib_documents()
            fingerprint[entry] = stdlib_identity()
            continue
        if entry in PROCEDURAL_SOURCES:
            found = PROCEDURAL_SOURCES[entry]()
            docs += found
            fingerprint[entry] = procedural_identity(found)
            continue
        files = [(p, name) for p, name in resolve_files(entry) if p.resolve() not in seen]
        seen.update(p.resolve() for p, _ in files)
        found = []
        for path, name in files:
            digest = hashlib.sha256()
            found += read_file(path, name, digest=digest)
            fingerprint[str(path)] = {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}
        if files and not found:
            raise ValueError(f"train.data.source: {entry!r} holds no non-empty documents")
        docs += found
    return Corpus(docs, fingerprint)


def load_documents(source: str) -> list[Document]:
    """The documents of `load_corpus(source)`."""
    return load_corpus(source).documents
