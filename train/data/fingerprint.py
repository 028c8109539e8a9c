"""A fingerprint of the data a run reads, so a resumed run notices that its data changed.

    fingerprint = data_fingerprint("stdlib,data/*.jsonl")
    data_changes(recorded, fingerprint)  # ["data/a.jsonl (120 -> 240 bytes)", "data/b.jsonl added"]

Files are identified by their path (as the source names them), size and the sha256 of their
content, taken while the corpus is read (train/data/corpus.py); the embedded stdlib corpus by the
Python version it comes from; a generated arithmetic task by a hash of its documents; a prepared
directory by the sha256 of its manifest, which holds every shard's sha256 (train/data/shards.py),
so no shard is read.
"""

from __future__ import annotations

from pathlib import Path

from train.data.corpus import load_corpus, source_entries
from train.data.manifest import is_prepared, prepared_fingerprint


def data_fingerprint(source: str) -> dict[str, dict]:
    """{entry: identity} for every corpus and file `source` (DataConfig.source) names."""
    entries = source_entries(source)
    if len(entries) == 1 and is_prepared(entries[0]):
        return prepared_fingerprint(Path(entries[0]))
    return load_corpus(source).fingerprint


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
