"""Hugging Face safetensors directories, whatever the model family: shard listing, header checks,
streaming reads and sharded writes.

A directory holds `model.safetensors`, or `model-0000k-of-0000N.safetensors` shards with
`model.safetensors.index.json` ({"weight_map": {tensor name: shard file}}), beside config.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
INT_DTYPES = {"I64": "int64", "I32": "int32"}  # lookup tables (DeepSeek-V4's tid2eid)


class CheckpointFormatError(ValueError):
    """A checkpoint file, tensor or config entry that does not fit the model (one line)."""


def read_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointFormatError(f"{path} not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointFormatError(f"{path}: not valid JSON ({err})") from None


@contextlib.contextmanager
def open_shard(file: Path) -> Iterator[Any]:
    """safetensors' lazy reader of `file`, once the file is known to hold all the bytes its
    header declares (an interrupted download or copy is cut short); a damaged file is a
    one-line `CheckpointFormatError` naming it."""
    size, declared = file.stat().st_size, _declared_size(file)
    if declared is None:
        raise CheckpointFormatError(f"{file}: not a complete safetensors file (its header "
                                    "cannot be read); copy or download it again")
    if size < declared:
        raise CheckpointFormatError(f"{file}: truncated: its header declares {declared} bytes, "
                                    f"the file has {size}; copy or download it again")
    try:
        with safe_open(file, framework="numpy") as reader:
            yield reader
    except SafetensorError as err:
        raise CheckpointFormatError(f"{file}: unreadable ({' '.join(str(err).split())})") from None


def _declared_size(file: Path) -> int | None:
    """Size of `file` by its header: the 8-byte header length, the JSON header, then the data up
    to the largest end offset. None: no readable header."""
    with open(file, "rb") as f:
        prefix = f.read(8)
        header_size = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        header = f.read(header_size) if 0 <= header_size <= file.stat().st_size else b""
    try:
        ends = [entry["data_offsets"][1] for name, entry in json.loads(header).items()
                if name != "__metadata__"]
        return 8 + header_size + max(ends, default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None


def shard_names(path: Path) -> dict[str, list[str]]:
    """{shard file: tensor names} from the index, or the single `model.safetensors`."""
    if (path / INDEX).is_file():
        weight_map = read_json(path / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointFormatError(f"{path / INDEX}: no 'weight_map'")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        return files
    if (path / SINGLE_FILE).is_file():
        with open_shard(path / SINGLE_FILE) as f:
            return {SINGLE_FILE: list(f.keys())}
    raise CheckpointFormatError(f"{path}: neither {INDEX} nor {SINGLE_FILE} found")


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:4])
    return f"{shown}, ... ({len(names)} in total)" if len(names) > 4 else shown


def check_tensors(path: Path, files: dict[str, list[str]],
                  expected: Mapping[str, Sequence[int]], integer: Collection[str] = ()) -> None:
    """Names, dtypes and shapes of every tensor against `expected` ({name: stored shape}), from
    the shard headers only (no data read), so a mismatch is reported before anything is loaded.
    Tensors named in `integer` hold integers (INT_DTYPES), the others floats."""
    stored = [name for names in files.values() for name in names]
    unknown = [name for name in stored if name not in expected]
    if unknown:
        raise CheckpointFormatError(f"{path}: unknown tensor (no stepjax variable): "
                                    f"{_listing(unknown)}")
    missing = sorted(set(expected) - set(stored))
    if missing:
        raise CheckpointFormatError(f"{path}: missing tensor: {_listing(missing)}")
    for file, names in files.items():
        if not (path / file).is_file():
            raise CheckpointFormatError(f"{path / file}: shard listed in {INDEX} not found")
        with open_shard(path / file) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointFormatError(f"{name}: listed under {file} in {INDEX} but "
                                                "not stored there")
                tensor = f.get_slice(name)
                allowed = INT_DTYPES if name in integer else FLOAT_DTYPES
                if tensor.get_dtype() not in allowed:
                    raise CheckpointFormatError(
                        f"{name}: dtype {tensor.get_dtype()} is not supported (expected "
                        f"{'/'.join(allowed)}; quantized checkpoints are not)")
                found, want = list(tensor.get_shape()), list(expected[name])
                if found != want:
                    raise CheckpointFormatError(f"{name}: expected {want}, found {found}")


def read_tensors(path: Path, files: dict[str, list[str]], *,
                 progress: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of every tensor, one shard open at a time through safetensors' lazy
    (memory-mapped) reader: only the tensor being yielded is materialised."""
    for file, names in tqdm(files.items(), desc="import", unit="shard", disable=not progress,
                            file=sys.stderr):
        with open_shard(path / file) as f:
            for name in names:
                yield name, f.get_tensor(name)


def shard_plan(sizes: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Consecutive tensor indices grouped into shards of at most `max_bytes` (a larger tensor
    gets a shard of its own)."""
    shards, current, used = [], [], 0
    for i, size in enumerate(sizes):
        if current and used + size > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    return shards + [current] if current else shards


def _default_file_mode() -> int:
    """The mode `open()` gives a new file under the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_tensors(directory: Path, names: Sequence[str], sizes: Sequence[int],
                  tensor: Callable[[int], np.ndarray], *, max_shard_bytes: int,
                  progress: bool = True) -> None:
    """Writes tensors `names` (in that order; `sizes` in bytes, `tensor(i)` materialises the
    i-th) as `model.safetensors`, or as shards of at most `max_shard_bytes` plus the index,
    holding one shard on the host at a time."""
    plan = shard_plan(sizes, max_shard_bytes)
    files = ([SINGLE_FILE] if len(plan) == 1 else
             [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))])
    for file, shard in tqdm(list(zip(files, plan)), desc="export", unit="shard",
                            disable=not progress, file=sys.stderr):
        save_file({names[i]: tensor(i) for i in shard}, directory / file,
                  metadata={"format": "pt"})
        # safetensors creates its files 0600 whatever the umask; shards are meant to be shared
        # like the config.json written beside them.
        os.chmod(directory / file, _default_file_mode())
    if len(plan) > 1:
        index = {"metadata": {"total_size": sum(sizes)},
                 "weight_map": {names[i]: file for file, shard in zip(files, plan)
                                for i in shard}}
        (directory / INDEX).write_text(json.dumps(index, indent=1) + "\n")
