"""The sweep file format (the keys are shown in `python -m train.sweep --help`, `sweep.py`): a
sweep's runs, each a set of overrides of the sweep's base run config (or of a named run's own
`base`, to compare model families that start from different presets), and its loader. With
both `grid` and `runs`, every named run is crossed with every grid point. The runner and command
line are `sweep.py`, the report `sweep_report.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path
from typing import Any, Sequence

from model.config import yaml_load
from train.config import RunConfig, load_run_config
from train.experiments.spec import override_list, read_spec, resolve_base

SWEEP_KEYS = ("grid", "runs", "metrics")  # besides spec.COMMON_KEYS


@dataclasses.dataclass(frozen=True)
class SweepRun:
    name: str
    overrides: tuple[str, ...]  # the run's own, after the sweep-wide ones
    base: Path | None = None  # the run's own base run config; None: the sweep's


@dataclasses.dataclass(frozen=True)
class Sweep:
    base: Path
    overrides: tuple[str, ...]
    runs: tuple[SweepRun, ...]
    description: str = ""
    metrics: tuple[str, ...] = ()  # extra metrics.jsonl names reported (last logged value)
    command_line: tuple[str, ...] = ()  # overrides given to the CLI: every run, last

    def run_overrides(self, run: SweepRun) -> list[str]:
        return [*self.overrides, *run.overrides, *self.command_line]

    def run_base(self, run: SweepRun) -> Path:
        return run.base or self.base

    def run_config(self, run: SweepRun) -> RunConfig:
        config = load_run_config(self.run_base(run), self.run_overrides(run))
        if not config.train.eval_every:  # every run must end with a held-out loss
            config = dataclasses.replace(config, train=dataclasses.replace(
                config.train, eval_every=config.train.steps))
        return config


def _override(key: str, value: Any) -> str:
    """`key=value` that parses back to `value`: plain when YAML reads it so, else in flow
    syntax (JSON is valid YAML)."""
    if isinstance(value, str) and yaml_load(value) == value:
        return f"{key}={value}"
    return f"{key}={json.dumps(value)}"


def _short(key: str, value: Any) -> str:
    shown = value if isinstance(value, str) else json.dumps(value)
    return f"{key.split('.')[-1]}={shown}"


def _grid_points(grid: Any) -> list[tuple[str, tuple[str, ...]]]:
    """[(name suffix, overrides)] of the cartesian product of `grid` ({key: [values]})."""
    if grid is None:
        return []
    if not isinstance(grid, dict) or not grid:
        raise ValueError(f"sweep grid: expected a mapping {{key: [values]}}, got {grid!r}")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"sweep grid.{key}: expected a non-empty list of values, got {values!r}")
    points = []
    for combo in itertools.product(*grid.values()):
        pairs = list(zip(grid, combo))
        points.append((",".join(_short(k, v) for k, v in pairs),
                       tuple(_override(k, v) for k, v in pairs)))
    return points


def _named_runs(runs: Any, path: Path) -> list[SweepRun]:
    """The `runs` list of the sweep file at `path`: {name, overrides, base (optional)} each; a
    run's `base` is resolved as the sweep's is (`spec.resolve_base`)."""
    if runs is None:
        return []
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"sweep runs: expected a non-empty list of {{name, overrides}}, got {runs!r}")
    out = []
    for i, entry in enumerate(runs):
        if (not isinstance(entry, dict) or set(entry) - {"name", "base", "overrides"}
                or "name" not in entry):
            raise ValueError(f"sweep runs[{i}]: expected {{name: ..., overrides: [...]}} and "
                             f"optionally base: ..., got {entry!r}")
        overrides = override_list(entry.get("overrides"), f"sweep runs[{i}].overrides")
        base = (resolve_base(entry["base"], path, f"sweep runs[{i}]") if "base" in entry
                else None)
        out.append(SweepRun(str(entry["name"]), overrides, base))
    return out


_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]+")


def load_sweep(path: str | Path, extra: Sequence[str] = ()) -> Sweep:
    """Reads and checks a sweep file; `extra` overrides (the command line's) apply to every
    run, last. Every run's config is resolved once here, so a typo in any run fails before the
    first one trains."""
    spec = read_spec(path, "sweep", SWEEP_KEYS)
    named = _named_runs(spec.values.get("runs"), spec.path)
    points = _grid_points(spec.values.get("grid"))
    if not named and not points:
        raise ValueError(f"sweep {spec.path}: needs a 'grid' and/or a 'runs' list")
    if named and points:
        runs = [SweepRun(f"{r.name},{suffix}", r.overrides + point, r.base)
                for r in named for suffix, point in points]
    else:
        runs = named or [SweepRun(suffix, point) for suffix, point in points]
    runs = [dataclasses.replace(r, name=_UNSAFE.sub("_", r.name)) for r in runs]
    names = [r.name for r in runs]
    hidden = [n for n in names if n.startswith(".")]  # ".", "..": the sweep's own directories
    if hidden:
        raise ValueError(f"sweep {spec.path}: run name {hidden[0]!r} is not a usable directory "
                         "name (runs train in DIR/runs/NAME); give the run a name that does "
                         "not start with '.'")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"sweep {spec.path}: run names must be unique, repeated: {duplicates}")
    metrics = spec.values.get("metrics") or []
    if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
        raise ValueError(f"sweep metrics: expected a list of metric names, got {metrics!r}")
    sweep = Sweep(base=spec.base, overrides=spec.overrides, runs=tuple(runs),
                  description=spec.description, metrics=tuple(metrics),
                  command_line=override_list(list(extra), "command-line overrides"))
    for run in sweep.runs:
        try:
            sweep.run_config(run)
        except ValueError as err:
            raise ValueError(f"sweep run {run.name}: {err}") from None
    return sweep
