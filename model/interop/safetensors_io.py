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
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Collection, Iterator, Mapping, NamedTuple, Sequence

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from model.interop.io_errors import os_reason

INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
INT_DTYPES = {"I64": "int64", "I32": "int32"}  # lookup tables (DeepSeek-V4's tid2eid)
# Quantized releases' dtypes (model/interop/quantized.py), read from the header's byte offsets:
# safetensors' numpy reader has no float8 types (numpy itself has none), ml_dtypes does.
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
              "I8": np.int8, "U8": np.uint8, "F32": np.dtype("<f4")}


class TensorInfo(NamedTuple):
    """One stored tensor as its shard's header describes it (no data read)."""

    file: str
    dtype: str  # safetensors' code: "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]
    span: tuple[int, int]  # its bytes, as offsets from the start of the file


class CheckpointFormatError(ValueError):
    """A checkpoint file, tensor or config entry that does not fit the model (one line)."""


def read_json(path: Path) -> dict:
    """The JSON object in `path` (config.json, the shard index)."""
    if not path.is_file():
        raise CheckpointFormatError(f"{path} not found")
    try:
        values = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointFormatError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(values, dict):
        raise CheckpointFormatError(f"{path}: expected a JSON object, got "
                                    f"{type(values).__name__}")
    return values


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


def _header(file: Path) -> tuple[int, dict] | None:
    """(where the data starts, the JSON header) of a safetensors file: an 8-byte little-endian
    header length, then the header. None: no readable header."""
    with open(file, "rb") as f:
        prefix = f.read(8)
        header_size = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        header = f.read(header_size) if 0 <= header_size <= file.stat().st_size else b""
    try:
        table = json.loads(header)
    except ValueError:
        return None
    return (8 + header_size, table) if isinstance(table, dict) else None


def _declared_size(file: Path) -> int | None:
    """Size of `file` by its header: up to the largest end offset of its data. None: no
    readable header."""
    found = _header(file)
    if found is None:
        return None
    try:
        ends = [entry["data_offsets"][1] for name, entry in found[1].items()
                if name != "__metadata__"]
        return found[0] + max(ends, default=0)
    except (TypeError, KeyError, IndexError, AttributeError):
        return None


def shard_names(path: Path) -> dict[str, list[str]]:
    """{shard file: tensor names} from the index, or the single `model.safetensors`."""
    if (path / INDEX).is_file():
        weight_map = read_json(path / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointFormatError(f"{path / INDEX}: no 'weight_map'")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if not _inside(file):
                raise CheckpointFormatError(
                    f"{path / INDEX}: weight_map sends {name} to {file!r}, which is not a file "
                    f"name inside {path}; shards must be listed by their names in the directory")
            files.setdefault(file, []).append(name)
        return files
    if (path / SINGLE_FILE).is_file():
        with open_shard(path / SINGLE_FILE) as f:
            return {SINGLE_FILE: list(f.keys())}
    raise CheckpointFormatError(f"{path}: neither {INDEX} nor {SINGLE_FILE} found")


def _inside(file: Any) -> bool:
    """A shard name of an index: a relative path that stays inside the checkpoint directory
    (no absolute path, no `..`, no backslash that Windows would read as a separator)."""
    if not isinstance(file, str) or not file or "\\" in file:
        return False
    parts = PurePosixPath(file).parts
    return not PurePosixPath(file).is_absolute() and ".." not in parts


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:4])
    return f"{shown}, ... ({len(names)} in total)" if len(names) > 4 else shown


def read_headers(path: Path, files: dict[str, list[str]]) -> dict[str, TensorInfo]:
    """{name: TensorInfo} of every tensor listed in `files`, from the shard headers only (no
    data read); a shard that is absent, cut short or lacks a tensor listed for it is named."""
    table = {}
    for file, names in files.items():
        if not (path / file).is_file():
            raise CheckpointFormatError(f"{path / file}: shard listed in {INDEX} not found")
        with open_shard(path / file):  # completeness checks
            pass
        start, header = _header(path / file)
        for name in names:
            if name not in header:
                raise CheckpointFormatError(f"{name}: listed under {file} in {INDEX} but "
                                            "not stored there")
            table[name] = _info(file, start, header[name])
    return table


def _info(file: str, start: int, entry: Mapping[str, Any]) -> TensorInfo:
    """TensorInfo of a header entry of `file`, whose data starts at byte `start`."""
    begin, end = entry["data_offsets"]
    return TensorInfo(file, entry["dtype"], tuple(entry["shape"]), (start + begin, start + end))


def check_tensors(path: Path, headers: Mapping[str, TensorInfo],
                  expected: Mapping[str, Sequence[int]], integer: Collection[str] = ()) -> None:
    """Names, dtypes and shapes of every tensor (`read_headers`) against `expected` ({name:
    stored shape}), so a mismatch is reported before anything is loaded. Tensors named in
    `integer` hold integers (INT_DTYPES), the others floats."""
    unknown = [name for name in headers if name not in expected]
    if unknown:
        raise CheckpointFormatError(f"{path}: unknown tensor (no stepjax variable): "
                                    f"{_listing(unknown)}")
    missing = sorted(set(expected) - set(headers))
    if missing:
        raise CheckpointFormatError(f"{path}: missing tensor: {_listing(missing)}")
    for name, tensor in headers.items():
        allowed = INT_DTYPES if name in integer else FLOAT_DTYPES
        if tensor.dtype not in allowed:
            raise CheckpointFormatError(
                f"{name}: dtype {tensor.dtype} is not supported (expected {'/'.join(allowed)})")
        found, want = list(tensor.shape), list(expected[name])
        if found != want:
            raise CheckpointFormatError(f"{name}: expected {want}, found {found}")


def read_tensor(path: Path, tensor: TensorInfo) -> np.ndarray:
    """The data of one tensor of a RAW_DTYPES dtype, from its bytes in the file."""
    begin, end = tensor.span
    data = np.fromfile(path / tensor.file, np.uint8, end - begin, offset=begin)
    return data.view(RAW_DTYPES[tensor.dtype]).reshape(tensor.shape)


def read_tensors(path: Path, files: dict[str, list[str]], *,
                 progress: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of every tensor, one shard open at a time through safetensors' lazy
    (memory-mapped) reader, or from its bytes for the float8 dtypes that reader lacks
    (`read_tensor`): only the tensor being yielded is materialised."""
    for file, names in tqdm(files.items(), desc="import", unit="shard", disable=not progress,
                            file=sys.stderr):
        with open_shard(path / file) as f:
            start, header = _header(path / file)
            for name in names:
                tensor = _info(file, start, header[name])
                numpy_reads = tensor.dtype in FLOAT_DTYPES or tensor.dtype in INT_DTYPES
                yield name, f.get_tensor(name) if numpy_reads else read_tensor(path, tensor)


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


def shard_files(count: int) -> list[str]:
    """File names of `count` shards: `model.safetensors`, or `model-0000k-of-0000N.safetensors`
    (listed in the INDEX)."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def write_index(directory: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    """The INDEX of a sharded directory: {tensor name: shard file}."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    (directory / INDEX).write_text(json.dumps(index, indent=1) + "\n")


def default_file_mode() -> int:
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
    files = shard_files(len(plan))
    for file, shard in tqdm(list(zip(files, plan)), desc="export", unit="shard",
                            disable=not progress, file=sys.stderr):
        try:
            save_file({names[i]: tensor(i) for i in shard}, directory / file,
                      metadata={"format": "pt"})
        except SafetensorError as err:  # its I/O errors, e.g. a full disk
            raise OSError(f"{file}: {os_reason(err)}") from None
        # safetensors creates its files 0600 whatever the umask; shards are meant to be shared
        # like the config.json written beside them.
        os.chmod(directory / file, default_file_mode())
    if len(plan) > 1:
        write_index(directory, {names[i]: file for file, shard in zip(files, plan) for i in shard},
                    sum(sizes))
