"""Which checkpoint a recipe stage started from, and whether it still holds
(train/experiments/recipe.py).

When stage k starts, DIR/stages/<kk>-<name>/recipe_start.json records the final checkpoint of
stage k-1 it starts from: its step and a fingerprint of that checkpoint (its saved config, the
run record of the stage's tokenizer and data, and orbax's commit metadata, which names the save
itself). Before a recipe trains anything, every stage already trained is checked against the
stage before it as that stage now stands or will stand: if the earlier stage will train on
(its `train.steps` raised), lost its checkpoints, or its final checkpoint is another one
(retrained or replaced), the later stage's weights no longer descend from it, and the recipe is
refused with the stages to move away. Nothing is moved or deleted: the saved stages are the
user's, and the refusal says how to keep them and retrain.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from model.interop.atomic_file import write_text_atomically
from model.interop.workdir import latest_run_config
from model.interop.workdir_record import RECORD_FILE

START_FILE = "recipe_start.json"


def checkpoint_identity(stage_dir: Path) -> dict | None:
    """{"step", "fingerprint"} of a stage's final checkpoint; None without one."""
    if not (Path(stage_dir) / "checkpoints").is_dir():
        return None
    step, config = latest_run_config(stage_dir)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for path in (Path(stage_dir) / RECORD_FILE,
                 Path(stage_dir) / "checkpoints" / str(step) / "_CHECKPOINT_METADATA"):
        digest.update(path.read_bytes() if path.is_file() else b"-")
    return {"step": step, "fingerprint": digest.hexdigest()}


def record_start(stage_dir: Path, previous: str, identity: dict) -> None:
    """Writes the record of the checkpoint (of stage `previous`) a stage starts from."""
    Path(stage_dir).mkdir(parents=True, exist_ok=True)
    write_text_atomically(Path(stage_dir) / START_FILE,
                          json.dumps({"stage": previous, **identity}, indent=2) + "\n")


def recorded_start(stage_dir: Path) -> dict | None:
    path = Path(stage_dir) / START_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is unreadable ({err}); move the stage away to retrain it") \
            from None


def staleness(previous_dir: Path, previous_steps: int, recorded: dict) -> str | None:
    """What happened to the stage in `previous_dir` (which trains to `previous_steps`) since a
    later stage started from its checkpoint `recorded`; None if nothing did."""
    now = checkpoint_identity(previous_dir)
    if now is None:
        return "has no checkpoint any more (it will train again from scratch)"
    if now["step"] < previous_steps:
        return f"will train on from step {now['step']} to {previous_steps}"
    if now["step"] != recorded["step"]:
        return f"now ends at step {now['step']}"
    if now["fingerprint"] != recorded["fingerprint"]:
        return "has been trained again since (its final checkpoint is another one)"
    return None


def check_descent(stages: list[tuple[str, Path, int]], log: Callable[[str], None],
                  write: bool) -> None:
    """Refuses (ValueError, one line) if a trained stage no longer descends from the stage
    before it. `stages`: (name, directory, train.steps) of every stage in order. A trained
    stage without a start record (written by an older stepjax) is noted and recorded as it
    stands (`write`: this process writes the workdir)."""
    for k in range(1, len(stages)):
        (before, before_dir, before_steps), (name, stage_dir, _) = stages[k - 1], stages[k]
        if not (stage_dir / "checkpoints").is_dir():
            continue
        recorded = recorded_start(stage_dir)
        if recorded is None:
            identity = checkpoint_identity(before_dir)
            if identity is not None:
                log(f"note: stage {name} has no record of the checkpoint it started from "
                    f"(an older stepjax wrote it); recording {before}'s step "
                    f"{identity['step']} as its start")
                if write:
                    record_start(stage_dir, before, identity)
                continue
            started, reason = "was trained from it", "has no checkpoint any more"
        else:
            started = f"was trained from its step {recorded['step']}"
            reason = staleness(before_dir, before_steps, recorded)
        if reason:
            moves = "; ".join(f"mv {d} {d}.old" for _, d, _ in stages[k:] if d.exists())
            raise ValueError(
                f"recipe: stage {name} ({stage_dir}) starts from stage {before}: it {started}, "
                f"but {before} {reason}, so {name} and the stages after it would keep weights "
                f"that do not descend from {before}'s; to retrain them and keep the old ones, "
                f"move them away ({moves}), or restore stage {before}'s settings")
