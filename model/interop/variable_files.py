"""A model's variables as safetensors files under stepjax's own names, written piece by piece
and read back slice by slice: the storage of a stepjax model directory (model_dir.py).

    writer = VariableWriter(directory, layout_of(abstract))  # files sized, headers written
    writer.write("params/layers/segment_1/block_0/moe/gate_proj", (r, e), array)  # a slice
    writer.close()                                           # every byte must have been written
    variables = read_variables(directory, target)            # each device reads its own part

A variable is named by its path, "/"-joined ("params/embed/embedding"). The files follow the
Hugging Face layout (`model.safetensors`, or shards of at most `max_shard_bytes` plus
`model.safetensors.index.json`, model/interop/safetensors_io.py), so any safetensors reader opens
them. Writing needs no variable in memory: a file is created at its final size with its header,
and each piece is written at its offset as it arrives. A slice at leading positions of a
stacked variable (a layer of a scanned segment, an expert of a layer) is one contiguous run of
bytes in row-major order, so importing a release streams tensor by tensor: host memory holds
one tensor, never the model. Reading memory-maps the files; each device's shard is cut from the
map and cast to the target dtype, so a sharded load reads each device's part only.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np

from model.interop.safetensors_io import (
    CheckpointFormatError,
    FLOAT_DTYPES,
    INT_DTYPES,
    default_file_mode,
    read_headers,
    shard_files,
    shard_names,
    shard_plan,
    write_index,
)

CODES = {**FLOAT_DTYPES, **INT_DTYPES}  # safetensors dtype code -> numpy dtype name
CODE_OF = {name: code for code, name in CODES.items()}


def numpy_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


class Variable(NamedTuple):
    name: str  # "/"-joined path: collection first
    dtype: str  # numpy dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * numpy_dtype(self.dtype).itemsize


def variable_name(path) -> str:
    """The stored name of a variable at a tree path (jax key path or tuple of str)."""
    return "/".join(str(getattr(k, "key", k)) for k in path)


def layout_of(tree: Any) -> list[Variable]:
    """Every leaf of `tree` (arrays or ShapeDtypeStructs, e.g. `abstract_variables`), in tree
    order."""
    return [Variable(variable_name(path), np.dtype(leaf.dtype).name, tuple(leaf.shape))
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


class WriteFailed(Exception):
    """Writing a variable file failed; the OSError is its __cause__."""


class _Place(NamedTuple):
    file: int  # index into the writer's open files
    start: int  # first byte of the variable in the file
    variable: Variable


class VariableWriter:
    """Writes the variables of `layout` into new files in `directory` (see the module
    docstring). `close()` checks that every variable was written whole."""

    def __init__(self, directory: Path, layout: list[Variable], *,
                 max_shard_bytes: int = 5 * 2**30):
        self.directory, self.layout = Path(directory), layout
        plan = shard_plan([v.nbytes for v in layout], max_shard_bytes)
        names = shard_files(len(plan))
        self._files: list[int] = []
        self._places: dict[str, _Place] = {}
        self._written: dict[str, set] = {}
        for file, shard in zip(names, plan):
            variables = [layout[i] for i in shard]
            header, offset = {"__metadata__": {"format": "stepjax"}}, 0
            for v in variables:
                header[v.name] = {"dtype": CODE_OF[v.dtype], "shape": list(v.shape),
                                  "data_offsets": [offset, offset + v.nbytes]}
                offset += v.nbytes
            encoded = json.dumps(header).encode()
            encoded += b" " * (-len(encoded) % 8)  # data aligned to 8 bytes, as safetensors pads
            descriptor = os.open(self.directory / file, os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                                 default_file_mode())
            self._files.append(descriptor)
            os.pwrite(descriptor, struct.pack("<Q", len(encoded)) + encoded, 0)
            os.ftruncate(descriptor, 8 + len(encoded) + offset)  # sparse until written
            for v in variables:
                begin = header[v.name]["data_offsets"][0]
                self._places[v.name] = _Place(len(self._files) - 1, 8 + len(encoded) + begin, v)
                self._written[v.name] = set()
        if len(plan) > 1:
            write_index(self.directory, {layout[i].name: file for file, shard in zip(names, plan)
                                         for i in shard}, sum(v.nbytes for v in layout))

    def write(self, name: str, index: tuple[int, ...], value: np.ndarray) -> None:
        """Variable `name` (index ()) or its slice at leading positions `index`, cast to the
        variable's dtype."""
        if name not in self._places:
            raise ValueError(f"{name}: not a variable of this model")
        place = self._places[name]
        variable = place.variable
        lead, rest = variable.shape[:len(index)], variable.shape[len(index):]
        if tuple(value.shape) != rest:
            raise ValueError(f"{name}{list(index)}: shape {tuple(value.shape)}, expected {rest}")
        data = np.ascontiguousarray(value, numpy_dtype(variable.dtype)).reshape(-1)
        slot = int(np.ravel_multi_index(index, lead)) if index else 0
        _write_all(self._files[place.file], data.view(np.uint8), place.start + slot * data.nbytes)
        self._written[name].add(tuple(index))

    def close(self, *, check: bool = True) -> None:
        """Closes the files; with `check`, raises naming the first variable not written
        whole."""
        for descriptor in self._files:
            os.close(descriptor)
        self._files = []
        for name, slots in self._written.items():
            depths = {len(index) for index in slots} or {0}
            expected = math.prod(self._places[name].variable.shape[:max(depths)])
            if check and (len(depths) > 1 or len(slots) != expected):
                raise ValueError(f"{name}: {len(slots)} of {expected} parts were written")


def _write_all(descriptor: int, data: np.ndarray, offset: int) -> None:
    """os.pwrite until every byte is written (one call may write less); WriteFailed on an
    OSError (a full disk)."""
    view = memoryview(data)
    while len(view):
        try:
            done = os.pwrite(descriptor, view, offset)
        except OSError as err:
            raise WriteFailed() from err
        view, offset = view[done:], offset + done


def read_variables(directory: Path, target: Any) -> Any:
    """`target` (a tree of ShapeDtypeStructs with shardings) filled from the files of
    `directory`: each leaf cast to its dtype and placed in its sharding, each device reading
    its own slice of the memory-mapped file. Missing, unknown or mis-shaped variables are
    named before any data is read."""
    directory = Path(directory)
    headers = read_headers(directory, shard_names(directory))
    leaves, tree = jax.tree_util.tree_flatten_with_path(target)
    wanted = {variable_name(path): leaf for path, leaf in leaves}
    unknown = sorted(set(headers) - set(wanted))
    missing = sorted(set(wanted) - set(headers))
    if unknown or missing:
        raise CheckpointFormatError(f"{directory}: " + "; ".join(
            f"{what} variable {names[0]}" + (f" (and {len(names) - 1} more)" if len(names) > 1
                                             else "")
            for what, names in (("unknown", unknown), ("missing", missing)) if names))
    for name, leaf in wanted.items():
        stored = headers[name]
        if tuple(stored.shape) != tuple(leaf.shape) or stored.dtype not in CODES:
            raise CheckpointFormatError(f"{directory}: {name} is {stored.dtype} "
                                        f"{list(stored.shape)}, expected {list(leaf.shape)}")

    def load(name: str, leaf) -> jax.Array:
        stored = headers[name]
        values = np.memmap(directory / stored.file, numpy_dtype(CODES[stored.dtype]), "r",
                           offset=stored.span[0], shape=tuple(stored.shape) or (1,))
        values = values.reshape(stored.shape)
        return jax.make_array_from_callback(
            leaf.shape, leaf.sharding, lambda index: np.asarray(values[index], leaf.dtype))

    return jax.tree_util.tree_unflatten(tree, [load(variable_name(path), leaf)
                                               for path, leaf in leaves])
