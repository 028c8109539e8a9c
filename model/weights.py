"""One loader for trained or imported weights, used by generation and RL.

    cfg, variables = load_model("runs/tiny")           # a `python -m train` workdir (latest step)
    cfg, variables = load_model("runs/rl")             # a `python -m rl` workdir: its policy
    cfg, variables = load_model("Step-3.5-Flash/")     # a Hugging Face checkpoint (model/interop/)
    cfg, variables = load_model("models/tiny")         # a stepjax model directory
    save_model_dir(cfg, variables, "models/tiny")

`variables` is {"params": ..., "balance": ...}, exactly `nn.meta.unbox` of
`model.lm.init_variables(CausalLM(cfg), ...)` (no `balance` when the model has no router bias),
on one device or, given a `mesh`, in the model's shardings (`model.parallel.rules`). Each
format lives in its own module under model/interop/; this one only picks the format.
"""

from __future__ import annotations

from pathlib import Path

import jax

from model.config import ModelConfig, config_from_dict
from model.interop.hf import load_hf_checkpoint
from model.interop.model_dir import (
    MODEL_CONFIG,
    is_model_dir,
    load_model_dir,
    save_model_dir,
    variables_target,
)
from model.interop.workdir import WORKDIR_KINDS, Checkpointer, latest_run_config, workdir_kind

__all__ = ["load_model", "save_model_dir"]


def load_model(path: str | Path, mesh: jax.sharding.Mesh | None = None, *,
               param_dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """(config, variables) from a stepjax model directory, a Hugging Face checkpoint or a
    training or RL workdir (its latest checkpoint's params and router biases only; of the
    policy for RL). `param_dtype`: the params cast to it as they load, the config saying so
    (training from a bfloat16 model directory with float32 masters); default: as stored (a
    model directory's, a workdir's run config's; float32 for a Hugging Face checkpoint)."""
    path = Path(path)
    if is_model_dir(path):
        return load_model_dir(path, mesh, param_dtype=param_dtype)
    if (path / "config.json").is_file():
        return load_hf_checkpoint(path, mesh, param_dtype=param_dtype, progress=False)
    if (path / "checkpoints").is_dir():
        config, variables = _load_workdir(path, mesh)
        if param_dtype is None or param_dtype == config.param_dtype:
            return config, variables
        config = config.replace(param_dtype=param_dtype)
        target = variables_target(config, mesh)
        return config, jax.tree.map(lambda x, t: x.astype(t.dtype), variables, target)
    problem = "does not exist" if not path.exists() else "is not a model directory"
    raise ValueError(f"{path} {problem}: expected a stepjax model directory ({MODEL_CONFIG}), a "
                     "Hugging Face checkpoint (config.json + *.safetensors) or a "
                     "`python -m train` or `python -m rl` workdir (checkpoints/)")


def _load_workdir(path: Path, mesh) -> tuple[ModelConfig, dict]:
    """The latest step's `params` and `balance` only (of the policy, for an RL workdir): the
    optimizer state is never read."""
    step, run = latest_run_config(path)
    config = config_from_dict(run["model"])
    target = variables_target(config, mesh)
    where = WORKDIR_KINDS[workdir_kind(run)].model_state
    for key in reversed(where):
        target = {key: target}
    checkpoints = Checkpointer(path / "checkpoints", keep=1 << 30)
    try:
        variables = checkpoints.restore_subset(step, target)
    finally:
        checkpoints.close()
    for key in where:
        variables = variables[key]
    return config, variables
