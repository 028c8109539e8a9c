"""The plan of `python -m train.data.prepare`: what the input is (files by size and modification
time: a re-run over unchanged input does nothing) and how it is cut into units of work, each
tokenized by one worker into its own shards.

    inputs = describe_inputs("web/*.jsonl,books")       # cheap: stat only
    units = plan_units(inputs, unit_bytes=64 << 20)     # one sequential read of text files

A unit is a span of one file (train/data/readers.py): text files are cut at the piece boundaries
the loader itself uses (a long `.txt` is read in the same pieces whether prepared or not) and
`.jsonl` files at line starts, with the number of the unit's first line so that document keys,
and so the held-out split, are those of the raw path; `.parquet` files are cut at row groups.
The embedded stdlib corpus and the procedural tasks are one unit each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from train.data.corpus import (
    PROCEDURAL_SOURCES,
    procedural_identity,
    resolve_files,
    source_entries,
    stdlib_identity,
)
from train.data.readers import (
    blocks,
    parquet_columns,
    parquet_file,
    parquet_is_chat,
    record_is_chat,
    split_lines,
    split_pieces,
)

SUFFIXES = (".txt", ".jsonl", ".parquet")  # what prepare reads (a run reads the first two)
UNIT_BYTES = 64 << 20  # input bytes per unit of work (and so per shard)


def describe_inputs(source: str) -> list[dict]:
    """One entry per file (path, name, size, mtime) or in-memory corpus of `source`, in the
    order a run would read them."""
    entries = source_entries(source)
    if not entries:
        raise ValueError("--source: empty; name files, directories, globs, stdlib or arith")
    inputs, seen = [], set()
    for entry in entries:
        if entry == "stdlib":
            inputs.append({"entry": entry, **stdlib_identity()})
        elif entry in PROCEDURAL_SOURCES:
            inputs.append({"entry": entry, **procedural_identity(PROCEDURAL_SOURCES[entry]())})
        else:
            for path, name in resolve_files(entry, SUFFIXES):
                if path.resolve() in seen:
                    continue
                seen.add(path.resolve())
                stat = path.stat()
                inputs.append({"entry": entry, "path": str(path), "name": name,
                               "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return inputs


def plan_units(inputs: list[dict], unit_bytes: int = UNIT_BYTES) -> list[dict]:
    """Units of work: {"input": index into `inputs`, "span": [start, stop, first, chat]
    (readers.Span) or None for a whole in-memory corpus, "bytes": input bytes}."""
    units = []
    for index, item in enumerate(inputs):
        if "path" not in item:
            units.append({"input": index, "span": None, "bytes": 0})
            continue
        path = Path(item["path"])
        spans = {".txt": _text_spans, ".jsonl": _jsonl_spans, ".parquet": _parquet_spans}
        for span, size in spans[path.suffix](path, unit_bytes):
            units.append({"input": index, "span": span, "bytes": size})
    return units


def _cuts(pieces: Iterator[bytes], unit_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(start, stop, pieces before start) of consecutive spans of whole pieces, each reaching
    at least `unit_bytes` (the last one: what is left)."""
    start = offset = count = first = 0
    for piece in pieces:
        offset += len(piece)
        count += 1
        if offset - start >= unit_bytes:
            yield start, offset, first
            start, first = offset, count
    if offset > start:
        yield start, offset, first


def _text_spans(path: Path, unit_bytes: int) -> Iterator[tuple[list, int]]:
    for start, stop, _ in _cuts(split_pieces(blocks(path)), unit_bytes):
        yield [start, stop, 1, False], stop - start


def _jsonl_spans(path: Path, unit_bytes: int) -> Iterator[tuple[list, int]]:
    chat = _jsonl_is_chat(path)
    lines = (line + b"\n" for line in split_lines(blocks(path)))
    for start, stop, before in _cuts(lines, unit_bytes):
        stop = min(stop, path.stat().st_size)  # the last line may lack its newline
        yield [start, stop, before + 1, chat], stop - start


def _jsonl_is_chat(path: Path) -> bool:
    """Whether the file's first record is a chat (readers decide the same way)."""
    for line in split_lines(blocks(path)):
        if line.strip():
            try:
                return record_is_chat(json.loads(line))
            except ValueError:
                return False  # the reader names the malformed line
    return False


def _parquet_spans(path: Path, unit_bytes: int) -> Iterator[tuple[list, int]]:
    table = parquet_file(path)
    chat = parquet_is_chat(parquet_columns(table, path))
    meta = table.metadata
    start = row = first = size = 0
    for group in range(meta.num_row_groups):
        size += meta.row_group(group).total_byte_size
        row += meta.row_group(group).num_rows
        if size >= unit_bytes or group == meta.num_row_groups - 1:
            yield [start, group + 1, first + 1, chat], size
            start, first, size = group + 1, row, 0
