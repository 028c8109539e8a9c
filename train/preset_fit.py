"""A preset's settings fitted to the run its overrides describe (`train.config.load_run_config`).

`python -m train --config configs/tiny.yaml --workdir W train.steps=6` tries a preset briefly;
its warm-up (24 of 240 steps) would exceed the run, so it is scaled to the same fraction.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, Sequence

from model.config import parse_override

_NOTED: set[str] = set()


def fit_warmup(preset: Mapping[str, Any], values: dict, overrides: Sequence[str],
               defaults: Mapping[str, int]) -> dict:
    """`values` (run YAML `preset` with `overrides` applied) with the preset's warm-up scaled
    down when an override shortens `train.steps` below it and none sets `train.warmup_steps`:
    a short try run of a preset keeps the preset's warm-up fraction instead of being refused.
    A warm-up the overrides set is the user's and stays (checked against the run as usual).
    `defaults`: TrainConfig's `steps` and `warmup_steps`, for a preset without them. Prints a
    one-line note (once per process: sweeps and recipes load a config several times)."""
    keys = {parse_override(o)[0] for o in overrides}
    train, file_train = values.get("train") or {}, preset.get("train") or {}
    if "train.steps" not in keys or "train.warmup_steps" in keys or not isinstance(
            train, Mapping) or not isinstance(file_train, Mapping):
        return values
    steps = train.get("steps")
    warmup = file_train.get("warmup_steps", defaults["warmup_steps"])
    file_steps = file_train.get("steps", defaults["steps"])
    numbers = (steps, warmup, file_steps)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in numbers) \
            or warmup <= steps:
        return values  # nothing to fit, or values the config checks will name
    fitted = min(steps, max(1, round(warmup * steps / file_steps)))
    note = (f"note: train.warmup_steps: the config's {warmup} warm-up steps of {file_steps} "
            f"scaled to {fitted} for train.steps={steps}; set train.warmup_steps to choose")
    if note not in _NOTED:
        _NOTED.add(note)
        print(note, file=sys.stderr)
    return {**values, "train": {**train, "warmup_steps": fitted}}
