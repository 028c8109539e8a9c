"""The tokenizer of any checkpoint a policy is read from: what RL starts from (`--init-from`),
judges (rl/rewards/judge.py) and distillation teachers (rl/distill/teachers.py) load. The
weights themselves come from `model.weights.load_model`, which reads every kind of checkpoint
(for a `python -m rl` workdir, its latest actor).

    config, variables = load_model("runs/rl_teacher_add")
    tokenizer = checkpoint_tokenizer(Path("runs/rl_teacher_add"), "")
"""

from __future__ import annotations

from pathlib import Path

from model.config import ConfigError
from model.interop.workdir import latest_run_config, saved_tokenizer
from model.interop.workdir_record import tokenizer_mismatch
from model.tokenizers.text import TextTokenizer, load_tokenizer


def checkpoint_tokenizer(checkpoint: Path, spec: str) -> TextTokenizer:
    """A checkpoint's tokenizer: `spec` if given (as `rl.tokenizer` names one), else the
    checkpoint's tokenizer.json, else the one a training workdir recorded or an RL workdir's
    `rl.tokenizer`; a workdir trained with another is refused. ConfigError("tokenizer", ...)
    otherwise."""
    if not spec and (checkpoint / "tokenizer.json").is_file():
        spec = str(checkpoint)
    elif not spec and (checkpoint / "checkpoints").is_dir():
        spec = saved_tokenizer(latest_run_config(checkpoint)[1])
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
