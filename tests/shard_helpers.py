"""A small raw corpus and its preparation, shared by the prepared-data tests
(tests/train/test_data_shards.py, tests/train/test_data_manifest.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import train.data.prepare as prepare_module
from train.data.readers import PIECE_BYTES

SAMPLE = Path(json.__file__).read_text()  # real Python source


def write_corpus(root: Path) -> str:
    """Short .txt files, a .txt file of several pieces (and units), a text .jsonl with metadata
    and a blank line -> a source naming them."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(12):
        text = SAMPLE[i * 300:i * 300 + 50 + 40 * i]
        (root / f"doc{i:02d}.txt").write_text(f"# doc {i}\n{text}")
    (root / "long.txt").write_text((SAMPLE * 16)[:3 * PIECE_BYTES + 1000])
    with open(root / "records.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"text": SAMPLE[i * 200:i * 200 + 30 + 7 * i], "lang": "EN",
                                "source": f"site{i % 3}"}) + ("\n\n" if i == 4 else "\n"))
    return f"{root}/*.txt,{root / 'records.jsonl'}"


def prepared(source: str, out: Path, *, fraction: float = 0.3, unit_bytes: int = 40_000,
             force: bool = False, log=lambda _: None) -> dict:
    """`python -m train.data.prepare` in this process (one worker, no progress bar)."""
    return prepare_module.prepare(argparse.Namespace(
        source=source, out=out, tokenizer="default", workers=1, heldout_fraction=fraction,
        unit_bytes=unit_bytes, force=force, progress=False), log=log)
