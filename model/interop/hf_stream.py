"""Reading a Hugging Face directory of any registered family as a stream of stepjax variable
pieces: every check first (config.json, shard headers, tensor names, dtypes and shapes, without
reading data), then one tensor at a time, dequantized, checked for NaN and laid out as the
variable (slice) it is. `load_hf_checkpoint` (model/interop/hf.py) places the pieces on devices;
`import_release` (model/interop/hf_import.py) writes them straight into a model directory.

    source = open_hf_checkpoint("Step-3.5-Flash/", param_dtype="bfloat16")  # checks only
    for entry, value in source.pieces(progress=True):   # value: numpy, in the variable's dtype
        ...
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import flax.linen as nn
import numpy as np

from model.config import ModelConfig
from model.interop import quantized
from model.interop.families import Family, checkpoint_family
from model.interop.safetensors_io import (
    CheckpointFormatError,
    TensorInfo,
    check_tensors,
    read_headers,
    read_json,
    read_tensors,
    shard_names,
)
from model.interop.tensor_names import Entry, lookup
from model.lm import abstract_variables


class HFSource(NamedTuple):
    """A checked Hugging Face directory, ready to stream (`open_hf_checkpoint`)."""

    path: Path
    model_type: str
    config: ModelConfig
    abstract: dict  # unboxed ShapeDtypeStructs of the variables
    entries: dict[str, Entry]  # by the name the files use
    stored: dict[str, TensorInfo]  # every stored tensor the import reads
    tensors: dict[str, list[str]]  # {shard file: tensor names to read}
    plan: Any  # quantized.plan's dequantization plan

    def pieces(self, progress: bool = True) -> Iterator[tuple[Entry, np.ndarray]]:
        """(entry, value) of every checkpoint tensor, value in our layout and in its variable's
        dtype (numpy); only the tensor being yielded is in memory. A tensor holding NaN or an
        infinity is refused by name."""
        # Closed on an error, so the progress bar ends its line before the error is printed.
        with contextlib.closing(read_tensors(self.path, self.tensors,
                                             progress=progress)) as stream:
            for name, array in quantized.dequantize(stream, self.path, self.stored, self.plan):
                _check_finite(name, array, self.stored[name].file)
                entry = self.entries[name]
                leaf = lookup(self.abstract[entry.collection], entry.path)
                yield entry, entry.transform.to_ours(array, entry.shape).astype(leaf.dtype)


def open_hf_checkpoint(path: str | Path, *, param_dtype: str | None = None) -> HFSource:
    """The HFSource of a Hugging Face directory, after every check that needs no tensor data;
    `param_dtype`: the params' dtype (default the config's float32; the router bias stays
    float32). DeepSeek-V4's own release layout (its tensor names and config keys) is read as
    well as transformers' (model/interop/deepseek_v4.py)."""
    path = Path(path)
    hf_config = read_json(path / "config.json")
    family = checkpoint_family(hf_config.get("model_type"))
    scheme = quantized.scheme_of(hf_config)
    config = _translated(family, hf_config, path / "config.json")
    if param_dtype is not None:
        config = config.replace(param_dtype=param_dtype)
    files = _without_ignored(shard_names(path), family.ignored_tensors)
    stored = read_headers(path, files)
    if family.stored_config is not None:
        config = family.stored_config(config, hf_config, stored)
    abstract = nn.meta.unbox(abstract_variables(config))
    entries = _named_as_stored(family.tensor_table(config, abstract), stored,
                               family.alternative_name)
    headers, plan = quantized.plan(scheme, stored)
    check_tensors(path, headers, {name: e.hf_shape for name, e in entries.items()},
                  integer={name for name, e in entries.items()
                           if np.issubdtype(lookup(abstract[e.collection], e.path).dtype,
                                            np.integer)})
    tensors = {file: [n for n in names if n in headers] for file, names in files.items()}
    return HFSource(path, hf_config["model_type"], config, abstract, entries, stored, tensors,
                    plan)


def _translated(family: Family, hf_config: dict, where: Path) -> ModelConfig:
    """The family's translation of config.json; a value it cannot use (a type or combination
    the checks before it did not name) is a one-line error naming the file."""
    try:
        return family.config_from_hf(hf_config)
    except CheckpointFormatError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as err:
        reason = " ".join(str(err).split())[:200]
        raise CheckpointFormatError(f"{where}: a value does not fit its key ({type(err).__name__}"
                                    f": {reason})") from None


def _check_finite(name: str, array: np.ndarray, file: str) -> None:
    """Refuses a tensor holding NaN or an infinity: the model would compute NaN everywhere."""
    if np.issubdtype(array.dtype, np.integer):
        return
    bad = ~np.isfinite(array)
    if bad.any():
        raise CheckpointFormatError(f"{name} (in {file}): {int(bad.sum())} of {array.size} values "
                                    "are NaN or infinite; the checkpoint is damaged, download or "
                                    "export it again")


def _named_as_stored(table: list[Entry], stored: Mapping[str, Any],
                     alternative: Callable[[str], str] | None) -> dict[str, Entry]:
    """{name: entry} under the table's names, or under the family's alternative names when the
    files hold more of those (so the checks name what is missing in the files' own layout)."""
    entries = {e.name: e for e in table}
    if alternative is None:
        return entries
    renamed = {alternative(name): e for name, e in entries.items()}
    if sum(n in stored for n in renamed) > sum(n in stored for n in entries):
        return renamed
    return entries


def _without_ignored(files: dict[str, list[str]], pattern: str | None) -> dict[str, list[str]]:
    """{shard file: tensor names} less the names the family's import skips."""
    if pattern is None:
        return files
    return {file: [n for n in names if not re.search(pattern, n)] for file, names in files.items()}
