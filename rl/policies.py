"""A policy from any checkpoint, and its tokenizer: what RL starts from (`--init-from`), judges
(rl/rewards/judge.py) and distillation teachers (rl/distill/teachers.py) load.

    config, variables = load_policy("runs/rl_teacher_add")      # an RL workdir: its actor
    config, variables = load_policy("runs/sft_arith")           # anything `load_model` reads
    tokenizer = checkpoint_tokenizer(Path("runs/rl_teacher_add"), "")

`model.weights.load_model` reads stepjax model directories, Hugging Face checkpoints and
`python -m train` workdirs; a `python -m rl` workdir is added here, on the RL floor that writes
it: its latest checkpoint's actor params and router biases (never the critic, the optimizer
states or the reference policy).
"""

from __future__ import annotations

from pathlib import Path

import jax

from model.config import ConfigError, ModelConfig, config_from_dict
from model.interop.model_dir import variables_target
from model.interop.workdir import Checkpointer, latest_run_config
from model.interop.workdir_record import tokenizer_mismatch
from model.tokenizers.text import TextTokenizer, load_tokenizer
from model.weights import load_model


def rl_workdir_config(path: Path) -> tuple[int, dict] | None:
    """(step, saved run config) of a `python -m rl` workdir (its config has an `rl` section),
    None for anything else."""
    if not (Path(path) / "checkpoints").is_dir():
        return None
    step, run = latest_run_config(Path(path))
    return (step, run) if "rl" in run else None


def load_policy(path: str | Path, mesh: jax.sharding.Mesh | None = None
                ) -> tuple[ModelConfig, dict]:
    """(config, variables) of a `python -m rl` workdir's latest actor, or of whatever
    `load_model` reads (model directory, HF checkpoint, training workdir)."""
    saved = rl_workdir_config(Path(path))
    if saved is None:
        return load_model(path, mesh)
    step, run = saved
    config = config_from_dict(run["model"])
    checkpoints = Checkpointer(Path(path) / "checkpoints", keep=1 << 30)
    try:
        restored = checkpoints.restore_subset(step, {"actor": variables_target(config, mesh)})
    finally:
        checkpoints.close()
    return config, restored["actor"]


def checkpoint_tokenizer(checkpoint: Path, spec: str) -> TextTokenizer:
    """A checkpoint's tokenizer: `spec` if given (as `rl.tokenizer` names one), else the
    checkpoint's tokenizer.json, else the one a training workdir recorded or an RL workdir's
    `rl.tokenizer`; a workdir trained with another is refused. ConfigError("tokenizer", ...)
    otherwise."""
    if not spec and (checkpoint / "tokenizer.json").is_file():
        spec = str(checkpoint)
    elif not spec and (checkpoint / "checkpoints").is_dir():
        run = latest_run_config(checkpoint)[1]
        spec = (run.get("train", {}).get("data", {}).get("tokenizer")
                or run.get("rl", {}).get("tokenizer"))
    if not spec:
        raise ConfigError("tokenizer", f"{checkpoint} holds no tokenizer.json and is not a "
                          "`python -m train` or `python -m rl` workdir; name its tokenizer")
    try:
        tokenizer = load_tokenizer(spec)
    except ValueError as err:  # its message names train.data.tokenizer
        raise ConfigError("tokenizer", str(err).partition(": ")[2]) from None
    mismatch = tokenizer_mismatch(checkpoint, tokenizer)
    if mismatch:
        raise ConfigError("tokenizer", mismatch)
    return tokenizer
