"""The stepjax model directory: a model's config and variables, nothing of a training run.

    save_model_dir(cfg, variables, "models/tiny")
    with writing_model_dir(cfg, "models/big") as (writer, staging):   # piece by piece
        writer.write(name, index, array)
    cfg, variables = load_model_dir(Path("models/tiny"), mesh=None, param_dtype=None)

It holds `model_config.json` ({"format": "stepjax-model-v2", "model": {ModelConfig fields}}, so
it also works as a model preset for `load_config`; `model.param_dtype` is the dtype the weights
are stored in) and the variables as safetensors files under `variables/`
(model/interop/variable_files.py), plus, for an imported release, its tokenizer files.
Directories of the first format ("stepjax-model-v1": an orbax checkpoint under `variables/`)
are still read. Directories are written next to their destination and renamed into place when
complete, and never into a non-empty directory (docs/architecture.md, Guarantees to users:
nothing already saved is lost). The shardings and restore targets here serve every format that
loads onto a mesh.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp

from model.config import ModelConfig, config_from_dict, config_to_dict
from model.interop.io_errors import os_reason
from model.interop.variable_files import (
    VariableWriter,
    WriteFailed,
    layout_of,
    read_variables,
    variable_name,
)
from model.interop.workdir import restore_target
from model.interop.workdir_lock import LOCK_FILE, claimed_workdir
from model.lm import abstract_variables
from model.parallel.rules import named, param_axes, param_specs

MODEL_CONFIG = "model_config.json"
FORMAT = "stepjax-model-v2"
ORBAX_FORMAT = "stepjax-model-v1"  # variables as an orbax checkpoint: read, no longer written


def variable_shardings(config: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> dict:
    """Sharding of every variable: the training layout on `mesh`
    (`model.parallel.rules.param_specs`), else this process's first device."""
    boxed = abstract_variables(config)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: device, nn.meta.unbox(boxed))
    return {name: named(mesh, param_specs(param_axes(tree), nn.meta.unbox(tree), mesh, config))
            for name, tree in boxed.items()}


def variables_target(config: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> dict:
    """ShapeDtypeStructs (with shardings) of the model's variables, what a checkpoint of them
    restores into."""
    return restore_target(nn.meta.unbox(abstract_variables(config)),
                          variable_shardings(config, mesh))


# ---- writing ------------------------------------------------------------------------------------


def check_fresh(path: Path) -> None:
    """Raises ValueError unless `path` is absent or an empty directory (but for a lock file)."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(p.name != LOCK_FILE for p in path.iterdir())):
        raise ValueError(f"{path} exists and is not empty; choose a new output directory "
                         "(nothing was written)")


@contextlib.contextmanager
def fresh_directory(path: Path) -> Iterator[Path]:
    """Yields a staging directory that becomes `path` when the block completes; on error it is
    removed and `path` is left as it was."""
    path = Path(path).absolute()
    check_fresh(path)
    staging = path.parent / f".{path.name}.partial-{os.getpid()}"
    staging.mkdir(parents=True)
    try:
        yield staging
        if (path / LOCK_FILE).exists():  # held by this writer (locked_output): it moves along
            (path / LOCK_FILE).rename(staging / LOCK_FILE)  # same inode, so still held
        if path.exists():
            path.rmdir()  # empty, checked above; raises if something appeared since
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@contextlib.contextmanager
def locked_output(path: Path) -> Iterator[None]:
    """Holds the workdir lock (model/interop/workdir_lock.py) of output directory `path`, new
    or empty, while a command writes it: a concurrent writer is refused naming the holder. A
    `path` this created is removed again if the block fails before writing it; a complete
    output keeps no lock file (the next writer finds it not empty and stops there)."""
    path = Path(path)
    check_fresh(path)
    with claimed_workdir(path, option="--out"):
        yield
        (path / LOCK_FILE).unlink(missing_ok=True)


@contextlib.contextmanager
def writing_model_dir(config: ModelConfig, path: str | Path) -> Iterator[tuple[VariableWriter,
                                                                            Path]]:
    """Yields (a writer of `config`'s variables, the staging directory, for files to go beside
    them); when the block completes, every variable must have been written, the config is
    written and the directory moved to `path` (new or empty). On any error nothing is left at
    `path`; a failed write (a full disk) is one OSError naming `path`, other errors of the
    block pass through unchanged."""
    try:
        with fresh_directory(Path(path)) as staging:
            writer = _guarded(lambda: VariableWriter(
                _made(staging / "variables"), layout_of(nn.meta.unbox(abstract_variables(config)))))
            try:
                yield writer, staging
            except BaseException:
                writer.close(check=False)
                raise
            _guarded(writer.close)
            _guarded(lambda: (staging / MODEL_CONFIG).write_text(
                json.dumps({"format": FORMAT, "model": config_to_dict(config)}, indent=1) + "\n"))
    except WriteFailed as err:
        raise OSError(f"writing {path} failed ({os_reason(err.__cause__)}); nothing was written "
                      "there: free disk space and re-run") from None


def _made(directory: Path) -> Path:
    directory.mkdir()
    return directory


def _guarded(write):
    """write() with an OSError raised as WriteFailed (reported by writing_model_dir)."""
    try:
        return write()
    except OSError as err:
        raise WriteFailed() from err


def save_model_dir(config: ModelConfig, variables: dict, path: str | Path) -> None:
    """Writes a stepjax model directory (see the module docstring) of `variables` (this
    process's arrays, one on the host at a time); `path` must be new or empty."""
    with writing_model_dir(config, path) as (writer, _):
        for key, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
            writer.write(variable_name(key), (), np.asarray(leaf))


# ---- reading ------------------------------------------------------------------------------------


def is_model_dir(path: Path) -> bool:
    return (Path(path) / MODEL_CONFIG).is_file()


def load_model_dir(path: Path, mesh: jax.sharding.Mesh | None = None, *,
                   param_dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """(config, variables) of a stepjax model directory, on one device or in the training
    shardings of `mesh`; `param_dtype`: cast the params to it as they are read (e.g. float32
    masters for training from a bfloat16 directory), the returned config saying so."""
    path = Path(path)
    try:
        saved = json.loads((path / MODEL_CONFIG).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path / MODEL_CONFIG}: not valid JSON ({err})") from None
    found = saved.get("format") if isinstance(saved, dict) else None
    if found not in (FORMAT, ORBAX_FORMAT):
        raise ValueError(f"{path / MODEL_CONFIG}: unknown format {found!r}, expected {FORMAT!r}")
    stored = config_from_dict(saved.get("model") or {})
    config = stored if param_dtype is None else stored.replace(param_dtype=param_dtype)
    if found == FORMAT:
        return config, read_variables(path / "variables", variables_target(config, mesh))
    with ocp.StandardCheckpointer() as checkpointer:
        variables = checkpointer.restore((path / "variables").absolute(),
                                         variables_target(stored, mesh))
    target = variables_target(config, mesh)
    return config, jax.tree.map(lambda x, t: x.astype(t.dtype), variables, target)
