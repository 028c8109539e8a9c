"""The stepjax model directory: a model's config and variables, nothing of a training run.

    save_model_dir(cfg, variables, "models/tiny")
    cfg, variables = load_model_dir(Path("models/tiny"), mesh=None)

It holds `model_config.json` ({"format": "stepjax-model-v1", "model": {ModelConfig fields}}, so
it also works as a model preset for `load_config`) and an orbax checkpoint of the variables
under `variables/`. Directories are written next to their destination and renamed into place
when complete, and never into a non-empty directory (docs/architecture.md, Guarantees to users:
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
import orbax.checkpoint as ocp

from model.config import ModelConfig, config_from_dict, config_to_dict
from model.interop.io_errors import os_reason
from model.interop.orbax_quiet import quiet_background_failures
from model.interop.workdir import restore_target
from model.interop.workdir_lock import LOCK_FILE, claimed_workdir
from model.lm import abstract_variables
from model.parallel.rules import named, param_axes, param_specs

MODEL_CONFIG = "model_config.json"
FORMAT = "stepjax-model-v1"


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


def save_model_dir(config: ModelConfig, variables: dict, path: str | Path) -> None:
    """Writes a stepjax model directory (see the module docstring); `path` must be new or
    empty. A failed write (a full disk) is one OSError, and nothing is left at `path`."""
    quiet_background_failures()  # the failure is reported once, here
    try:
        with fresh_directory(Path(path)) as staging:
            with ocp.StandardCheckpointer() as checkpointer:  # leaving it waits for the save
                checkpointer.save(staging / "variables", variables)
            (staging / MODEL_CONFIG).write_text(
                json.dumps({"format": FORMAT, "model": config_to_dict(config)}, indent=1) + "\n")
    except Exception as err:  # orbax wraps OS errors in ValueError and others
        raise OSError(f"writing {path} failed ({os_reason(err)}); nothing was written there: "
                      "free disk space and re-run") from None


# ---- reading ------------------------------------------------------------------------------------


def is_model_dir(path: Path) -> bool:
    return (Path(path) / MODEL_CONFIG).is_file()


def model_dir_config(path: Path) -> ModelConfig:
    """The config of a stepjax model directory (its weights are not read)."""
    path = Path(path)
    try:
        saved = json.loads((path / MODEL_CONFIG).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path / MODEL_CONFIG}: not valid JSON ({err})") from None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(f"{path / MODEL_CONFIG}: unknown format "
                         f"{saved.get('format') if isinstance(saved, dict) else None!r}, "
                         f"expected {FORMAT!r}")
    return config_from_dict(saved.get("model") or {})


def load_model_dir(path: Path, mesh: jax.sharding.Mesh | None = None) -> tuple[ModelConfig, dict]:
    """(config, variables) of a stepjax model directory, on one device or in the training
    shardings of `mesh`."""
    path = Path(path)
    config = model_dir_config(path)
    with ocp.StandardCheckpointer() as checkpointer:
        variables = checkpointer.restore((path / "variables").absolute(),
                                         variables_target(config, mesh))
    return config, variables
