"""A fingerprint of `train.data.source`, so a resumed run notices that its data changed.

    fingerprint = data_fingerprint("stdlib,data/*.jsonl")
    data_changes(recorded, fingerprint)  # ["data/a.jsonl (120 -> 240 bytes)", "data/b.jsonl added"]

Files are identified by their path (as the source names them), size and the sha256 of their
content (data is read whole at start-up anyway, train/data/corpus.py); the embedded stdlib corpus
by the Python version it comes from; a generated arithmetic task by a hash of its documents.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from train.data.corpus import PROCEDURAL_SOURCES, resolve_files, stdlib_root

CHUNK = 1 << 20  # bytes hashed per read


def data_fingerprint(source: str) -> dict[str, dict]:
    """{entry: identity} for every corpus and file `source` names (DataConfig.source)."""
    fingerprint = {}
    for entry in (e.strip() for e in source.split(",") if e.strip()):
        if entry == "stdlib":
            fingerprint[entry] = {"python": sys.version.split()[0], "root": str(stdlib_root())}
        elif entry in PROCEDURAL_SOURCES:
            docs = PROCEDURAL_SOURCES[entry]()
            digest = hashlib.sha256("\n".join(d.text for d in docs).encode()).hexdigest()
            fingerprint[entry] = {"documents": len(docs), "sha256": digest}
        else:
            for path, _ in resolve_files(entry):
                fingerprint[str(path)] = {"bytes": path.stat().st_size, "sha256": _file_hash(path)}
    return fingerprint


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def data_changes(recorded: dict[str, dict], current: dict[str, dict]) -> list[str]:
    """What differs between two fingerprints, one short phrase per entry."""
    changes = []
    for name in sorted(recorded.keys() | current.keys()):
        old, new = recorded.get(name), current.get(name)
        if old == new:
            continue
        if old is None:
            changes.append(f"{name} added")
        elif new is None:
            changes.append(f"{name} removed")
        elif "bytes" in old and "bytes" in new and old["bytes"] != new["bytes"]:
            changes.append(f"{name} ({old['bytes']} -> {new['bytes']} bytes)")
        else:
            differ = [f"{k} {old.get(k)} -> {new.get(k)}" for k in sorted(old.keys() | new.keys())
                      if k != "sha256" and old.get(k) != new.get(k)]
            changes.append(f"{name} ({', '.join(differ) or 'content changed'})")
    return changes
