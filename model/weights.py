"""One loader for trained or imported weights and their tokenizer, used by training
(`--init-from`), evaluation, generation and RL.

    cfg, variables = load_model("runs/tiny")           # a `python -m train` workdir (latest step)
    cfg, variables = load_model("runs/tiny/checkpoints/400")   # that workdir's step 400
    cfg, variables = load_model("runs/rl")             # a `python -m rl` workdir: its policy
    cfg, variables = load_model("Step-3.5-Flash/")     # a Hugging Face checkpoint (model/interop/)
    cfg, variables = load_model("models/tiny")         # a stepjax model directory
    cfg = load_model_config("runs/tiny")               # the config alone, no weights read
    tokenizer = checkpoint_tokenizer(Path("runs/tiny"), "")
    save_model_dir(cfg, variables, "models/tiny")

`variables` is {"params": ..., "balance": ...}, exactly `nn.meta.unbox` of
`model.lm.init_variables(CausalLM(cfg), ...)` (no `balance` when the model has no router bias),
on one device or, given a `mesh`, in the model's shardings (`model.parallel.rules`). Each
format lives in its own module under model/interop/; this one only picks the format.
"""

from __future__ import annotations

from pathlib import Path

import jax

from model.config import ConfigError, ModelConfig, config_from_dict
from model.interop.hf import load_hf_checkpoint
from model.interop.hf_stream import read_hf_config
from model.interop.model_dir import (
    MODEL_CONFIG,
    is_model_dir,
    load_model_dir,
    read_model_dir_config,
    save_model_dir,
    variables_target,
)
from model.interop.workdir import (
    WORKDIR_KINDS,
    Checkpointer,
    latest_run_config,
    saved_tokenizer,
    split_checkpoint_step,
    workdir_kind,
)
from model.interop.workdir_record import tokenizer_mismatch
from model.tokenizers.text import TextTokenizer, load_tokenizer

__all__ = ["checkpoint_tokenizer", "load_model", "load_model_config", "save_model_dir"]


def load_model(path: str | Path, mesh: jax.sharding.Mesh | None = None, *,
               param_dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """(config, variables) from a stepjax model directory, a Hugging Face checkpoint or a
    training or RL workdir (its latest checkpoint's params and router biases only, or those of
    the step `DIR/checkpoints/<step>` names; of the policy for RL). `param_dtype`: the params
    cast to it as they load, the config saying so (training from a bfloat16 model directory
    with float32 masters); default: as stored (a model directory's, a workdir's run config's;
    float32 for a Hugging Face checkpoint)."""
    kind, path, step = _source_kind(Path(path))
    if kind == "model_dir":
        return load_model_dir(path, mesh, param_dtype=param_dtype)
    if kind == "hf":
        return load_hf_checkpoint(path, mesh, param_dtype=param_dtype, progress=False)
    config, variables = _load_workdir(path, mesh, step)
    if param_dtype is None or param_dtype == config.param_dtype:
        return config, variables
    config = config.replace(param_dtype=param_dtype)
    target = variables_target(config, mesh)
    return config, jax.tree.map(lambda x, t: x.astype(t.dtype), variables, target)


def load_model_config(path: str | Path) -> ModelConfig:
    """The config `load_model(path)` returns, read from config files only (no weights)."""
    kind, path, step = _source_kind(Path(path))
    if kind == "model_dir":
        return read_model_dir_config(path)
    if kind == "hf":
        return read_hf_config(path).config
    return config_from_dict(latest_run_config(path, step)[1]["model"])


def checkpoint_tokenizer(checkpoint: Path, spec: str) -> TextTokenizer:
    """A checkpoint's tokenizer: `spec` if given (as `rl.tokenizer` names one), else the
    checkpoint's tokenizer.json, else the one a training workdir recorded or an RL workdir's
    `rl.tokenizer`; a workdir trained with another is refused. ConfigError("tokenizer", ...)
    otherwise."""
    workdir, step = split_checkpoint_step(Path(checkpoint))
    if not spec and (workdir / "tokenizer.json").is_file():
        spec = str(workdir)
    elif not spec and (workdir / "checkpoints").is_dir():
        spec = saved_tokenizer(latest_run_config(workdir, step)[1])
    if not spec:
        raise ConfigError("tokenizer", f"{checkpoint} holds no tokenizer.json and is not a "
                          "`python -m train` or `python -m rl` workdir; name its tokenizer")
    try:
        tokenizer = load_tokenizer(spec)
    except ValueError as err:  # its message names train.data.tokenizer
        raise ConfigError("tokenizer", str(err).partition(": ")[2]) from None
    mismatch = tokenizer_mismatch(workdir, tokenizer)
    if mismatch:
        raise ConfigError("tokenizer", mismatch)
    return tokenizer


def _source_kind(path: Path) -> tuple[str, Path, int | None]:
    """("model_dir" | "hf" | "workdir", the directory, the workdir's step or None)."""
    workdir, step = split_checkpoint_step(path)
    if step is not None and (workdir / "checkpoints").is_dir():
        return "workdir", workdir, step
    if is_model_dir(path):
        return "model_dir", path, None
    if (path / "config.json").is_file():
        return "hf", path, None
    if (path / "checkpoints").is_dir():
        return "workdir", path, None
    problem = "does not exist" if not path.exists() else "is not a model directory"
    raise ValueError(f"{path} {problem}: expected a stepjax model directory ({MODEL_CONFIG}), a "
                     "Hugging Face checkpoint (config.json + *.safetensors), a "
                     "`python -m train` or `python -m rl` workdir (checkpoints/) or one of its "
                     "steps (DIR/checkpoints/<step>)")


def _load_workdir(path: Path, mesh, step: int | None) -> tuple[ModelConfig, dict]:
    """The `params` and `balance` of the latest step or of `step` only (of the policy, for an
    RL workdir): the optimizer state is never read."""
    step, run = latest_run_config(path, step)
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
