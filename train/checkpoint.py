"""Resuming a run: which settings changed since its newest checkpoint.

The workdir's on-disk layout and its `Checkpointer` live in `model.interop.workdir`, next to the
other formats a model loads from.
"""

from pathlib import Path

from model.interop.workdir import WORKDIR_KINDS, CheckpointError, latest_run_config, workdir_kind
from train.config import RunConfig, resume_changes


def check_training_checkpoint(saved: dict, workdir: Path, hint: str) -> None:
    """Raises CheckpointError unless run config `saved` (a checkpoint's) is a training run's:
    another command's workdir (an RL run's) is named as such, with `hint` on what to do."""
    kind = workdir_kind(saved)
    if kind != "train":
        raise CheckpointError(f"{workdir} is a workdir of `{WORKDIR_KINDS[kind].command}`, not "
                              f"of `python -m train`; {hint}")


def changed_since_checkpoint(workdir: Path, run: RunConfig) -> list[str]:
    """Dotted names of the fields in which `run` differs from the config of the workdir's newest
    checkpoint, leaving out those a resumed run may change; compared as a resume compares them
    (`train.config.resume_changes`: a field added since the checkpoint counts at its default)."""
    _, saved = latest_run_config(workdir)
    return resume_changes(saved, run)
