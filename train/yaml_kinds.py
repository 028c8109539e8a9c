"""The repository's YAML files that are not run YAMLs (staged recipes, sweeps, RL run configs),
named where a run YAML or model preset belongs (`python -m train --config`,
`benchmarks.lowering --config`, ...) instead of being read as model fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

RUN_SECTIONS = ("model", "train", "mesh")
# top-level key -> (what the file is, the command that takes it)
OTHER_KINDS = {"stages": ("a staged recipe", "python -m train --recipe"),
               "runs": ("a sweep", "python -m train.sweep --sweep"),
               "grid": ("a sweep", "python -m train.sweep --sweep"),
               "rl": ("an RL run config", "python -m rl --config"),
               "task": ("an RL run config", "python -m rl --config")}


def check_run_yaml(values: Mapping[str, Any], path: str | Path) -> None:
    """Raises ValueError if the YAML `values` read from `path` has no run section but another
    kind's key, naming the kind, its command and what to give instead (its `base:` if any)."""
    if set(RUN_SECTIONS) & set(values):
        return
    for key, (kind, command) in OTHER_KINDS.items():
        if key in values:
            base = values.get("base")
            example = f"its base, {base}" if isinstance(base, str) else "configs/tiny.yaml"
            raise ValueError(f"config file {str(path)!r} is {kind} ({key}:), not a run YAML: "
                             f"`{command} {path}` takes it; here give a run YAML or model "
                             f"preset such as {example}")
