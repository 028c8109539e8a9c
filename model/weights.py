"""One loader for trained or imported weights, used by generation and RL.

    cfg, variables = load_model("runs/tiny")           # a `python -m train` workdir (latest step)
    cfg, variables = load_model("Step-3.5-Flash/")     # a Hugging Face checkpoint (model/interop/hf.py)
    cfg, variables = load_model("models/tiny")         # a stepjax model directory
    save_model_dir(cfg, variables, "models/tiny")

`variables` is {"params": ..., "balance": ...}, exactly `nn.meta.unbox(CausalLM(cfg).init(...))`
(no `balance` when the model has no router bias), on one device or, given a `mesh`, in the
training shardings (train/parallel/sharding.py). A stepjax model directory holds `model_config.json`
({"format": "stepjax-model-v1", "model": {ModelConfig fields}}, so it also works as a model
preset for `load_config`) and an orbax checkpoint of the variables under `variables/`.
Directories are written next to their destination and renamed into place when complete, and
never into a non-empty directory (DESIGN.md §6: nothing already saved is lost).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from model.config import ModelConfig, config_from_dict, config_to_dict
from model.interop.workdir import Checkpointer, latest_run_config
from model.lm import CausalLM
from model.parallel.rules import named, param_axes, param_specs

MODEL_CONFIG = "model_config.json"
FORMAT = "stepjax-model-v1"


@functools.lru_cache(maxsize=8)
def abstract_variables(config: ModelConfig) -> dict:
    """Boxed (logical axes kept) ShapeDtypeStructs of `CausalLM(config).init(...)`."""
    return jax.eval_shape(
        lambda: CausalLM(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))


def variable_shardings(config: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> dict:
    """Sharding of every variable: the training layout on `mesh` (`model.parallel.rules.param_specs`),
    else this process's first device."""
    boxed = abstract_variables(config)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: device, nn.meta.unbox(boxed))
    return {name: named(mesh, param_specs(param_axes(tree), nn.meta.unbox(tree), mesh, config))
            for name, tree in boxed.items()}


def restore_target(config: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> dict:
    """ShapeDtypeStructs (with shardings) of the variables, what a checkpoint restores into."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        nn.meta.unbox(abstract_variables(config)),
                        variable_shardings(config, mesh))


# ---- writing ------------------------------------------------------------------------------------


def check_fresh(path: Path) -> None:
    """Raises ValueError unless `path` is absent or an empty directory."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
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
        if path.exists():
            path.rmdir()  # empty, checked above; raises if something appeared since
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def save_model_dir(config: ModelConfig, variables: dict, path: str | Path) -> None:
    """Writes a stepjax model directory (see the module docstring); `path` must be new or empty."""
    with fresh_directory(Path(path)) as staging:
        with ocp.StandardCheckpointer() as checkpointer:  # leaving the block waits for the save
            checkpointer.save(staging / "variables", variables)
        (staging / MODEL_CONFIG).write_text(
            json.dumps({"format": FORMAT, "model": config_to_dict(config)}, indent=1) + "\n")


# ---- reading ------------------------------------------------------------------------------------


def load_model(path: str | Path, mesh: jax.sharding.Mesh | None = None) -> tuple[ModelConfig, dict]:
    """(config, variables) from a stepjax model directory, a Hugging Face Step 3.5 checkpoint
    or a training workdir (its latest checkpoint's params and router biases only)."""
    path = Path(path)
    if (path / MODEL_CONFIG).is_file():
        return _load_model_dir(path, mesh)
    if (path / "config.json").is_file():
        from model.interop.hf import load_hf_checkpoint  # model.hf builds on this module

        return load_hf_checkpoint(path, mesh, progress=False)
    if (path / "checkpoints").is_dir():
        return _load_workdir(path, mesh)
    problem = "does not exist" if not path.exists() else "is not a model directory"
    raise ValueError(f"{path} {problem}: expected a stepjax model directory ({MODEL_CONFIG}), a "
                     "Hugging Face Step 3.5 checkpoint (config.json + *.safetensors) or a "
                     "`python -m train` workdir (checkpoints/)")


def _load_model_dir(path: Path, mesh) -> tuple[ModelConfig, dict]:
    try:
        saved = json.loads((path / MODEL_CONFIG).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path / MODEL_CONFIG}: not valid JSON ({err})") from None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(f"{path / MODEL_CONFIG}: unknown format "
                         f"{saved.get('format') if isinstance(saved, dict) else None!r}, "
                         f"expected {FORMAT!r}")
    config = config_from_dict(saved.get("model") or {})
    with ocp.StandardCheckpointer() as checkpointer:
        variables = checkpointer.restore((path / "variables").absolute(),
                                         restore_target(config, mesh))
    return config, variables


def _load_workdir(path: Path, mesh) -> tuple[ModelConfig, dict]:
    """The latest step's `params` and `balance` only: the optimizer state is never read."""
    step, run = latest_run_config(path)
    config = config_from_dict(run["model"])
    checkpoints = Checkpointer(path / "checkpoints", keep=1 << 30)
    try:
        return config, checkpoints.restore_subset(step, restore_target(config, mesh))
    finally:
        checkpoints.close()
