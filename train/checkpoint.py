"""Resuming a run: which settings changed since its newest checkpoint.

The workdir's on-disk layout and its `Checkpointer` live in `model.interop.workdir`, next to the
other formats a model loads from.
"""

from pathlib import Path

from model.interop.workdir import latest_run_config
from train.config import incompatible_fields


def changed_since_checkpoint(workdir: Path, current: dict) -> list[str]:
    """Dotted names of the fields in which `current` (a `RunConfig.to_dict()`) differs from the
    config of the workdir's newest checkpoint, leaving out those a resumed run may change
    (`train.config.incompatible_fields`)."""
    _, saved = latest_run_config(workdir)
    return incompatible_fields(saved, current)
