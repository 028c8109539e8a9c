"""A Hugging Face release -> a stepjax model directory, streamed tensor by tensor:
`python -m model.hf import`.

    summary = import_release("Step-3.5-Flash/", "models/flash", dtype="bfloat16")
    print(summary.line())   # family, parameters, dtype, bytes written, where

Every check runs first (config.json, shard headers, tensor names and shapes, the tokenizer
files), then each tensor is read, dequantized if quantized, cast to `dtype` and written at its
place in the model directory's variable files (model/interop/variable_files.py): host memory
holds one tensor (a few copies while it is converted, and the shard's memory map), never the
model, whatever its size. The release's tokenizer and chat template files are copied beside the
variables, so `python -m model.generate --workdir MODEL_DIR` and `python -m model.chat` read
them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import NamedTuple

from model.interop.hf_stream import open_hf_checkpoint
from model.interop.model_dir import writing_model_dir
from model.interop.variable_files import variable_name
from model.interop.workdir_lock import LOCK_FILE  # held by `python -m model.hf` while writing
from flax.traverse_util import flatten_dict

from model.config.cli import human
from model.summary import count_params
from model.tokenizers.chat import load_chat_tokenizer

# What a release holds for chat: the tokenizer (tokenizer.json), its special tokens and chat
# template (tokenizer_config.json, special_tokens_map.json, chat_template.jinja) and the ids
# generation stops at (generation_config.json): what `load_chat_tokenizer` reads.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


class ImportSummary(NamedTuple):
    model_type: str
    parameters: int  # every parameter, MTP heads included
    active: int  # per token
    dtype: str
    bytes_written: int
    path: Path
    tokenizer_files: tuple[str, ...]  # copied from the release
    has_chat_template: bool

    def line(self) -> str:
        """One line: family, parameters, dtype, bytes written, where, what else came along."""
        tokenizer = ("tokenizer and chat template copied" if self.has_chat_template else
                     "tokenizer copied (no chat template)" if self.tokenizer_files else
                     "no tokenizer in the release")
        return (f"imported {self.model_type}: {human(self.parameters)} parameters "
                f"({human(self.active)} active), {self.dtype}, "
                f"{human(self.bytes_written, 'B')} written to {self.path}; {tokenizer}")


def release_tokenizer_files(source: Path) -> tuple[tuple[str, ...], bool]:
    """(the TOKENIZER_FILES `source` holds, whether they give a chat template), after checking
    that they load (`load_chat_tokenizer`: a damaged file is named before the import starts)."""
    files = tuple(name for name in TOKENIZER_FILES if (source / name).is_file())
    if "tokenizer.json" not in files:
        return (), False
    return files, "default" in load_chat_tokenizer(source).templates


def import_release(source: str | Path, out: str | Path, *, dtype: str = "bfloat16",
                   progress: bool = True) -> ImportSummary:
    """Writes the model directory `out` (new or empty; nothing is left there on failure) of
    the Hugging Face directory `source`, its params in `dtype` (router biases stay float32),
    with the release's tokenizer files."""
    source, out = Path(source), Path(out)
    checkpoint = open_hf_checkpoint(source, param_dtype=dtype)
    tokenizer_files, has_template = release_tokenizer_files(source)
    with writing_model_dir(checkpoint.config, out) as (writer, staging):
        for entry, value in checkpoint.pieces(progress):
            writer.write(variable_name((entry.collection, *entry.path)), entry.index, value)
        for name in tokenizer_files:
            shutil.copyfile(source / name, staging / name)
    params = flatten_dict(checkpoint.abstract["params"])
    shapes = {path: leaf.shape for path, leaf in params.items()}
    counts = count_params(checkpoint.config, shapes)["with_mtp"]
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and f.name != LOCK_FILE)
    return ImportSummary(checkpoint.model_type, counts["total"], counts["active"], dtype,
                         written, out, tokenizer_files, has_template)
