"""The start every experiment file shares (sweeps, `sweep_file.py`; staged recipes,
`recipe.py`): a YAML mapping of known keys naming a `base` run config, `overrides` for every
run, and an optional `description`. Errors are one line that names the file kind and the key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from model.config import did_you_mean, read_yaml

COMMON_KEYS = ("base", "overrides", "description")


@dataclasses.dataclass(frozen=True)
class SpecFile:
    path: Path
    values: dict[str, Any]  # the whole mapping, for the keys of the file's own kind
    base: Path  # the run YAML, resolved (from the current directory, then the file's own)
    overrides: tuple[str, ...]  # for every run, first
    description: str


def read_spec(path: str | Path, kind: str, keys: Sequence[str]) -> SpecFile:
    """Reads a `kind` ("sweep", "recipe") file whose keys are COMMON_KEYS and `keys`, and checks
    the common ones."""
    path = Path(path)
    values = read_yaml(path)
    expected = (*COMMON_KEYS, *keys)
    unknown = sorted(set(values) - set(expected), key=str)
    if unknown:
        raise ValueError(f"{kind} {path}: unknown key(s) {unknown}"
                         f"{did_you_mean(str(unknown[0]), expected)}; expected "
                         f"{', '.join(expected)}")
    return SpecFile(path=path, values=values, base=resolve_base(values.get("base"), path, kind),
                    overrides=override_list(values.get("overrides"), f"{kind} overrides"),
                    description=str(values.get("description") or ""))


def override_list(values: Any, where: str) -> tuple[str, ...]:
    """The `overrides:` list of a sweep or recipe file (None: none), checked to be `key=value`
    strings; `where` names it in the error."""
    if values is None:
        return ()
    if not isinstance(values, list) or not all(isinstance(v, str) and "=" in v for v in values):
        raise ValueError(f"{where}: expected a list of 'key=value' strings, got {values!r}")
    return tuple(values)


def resolve_base(base: Any, spec_file: Path, kind: str) -> Path:
    """The run YAML that a sweep or recipe file (`kind`) names as `base`: a relative path is
    tried from the current directory, then from the file's own directory."""
    if not isinstance(base, str) or not base:
        raise ValueError(f"{kind} base: expected the path of a run YAML, e.g. configs/tiny.yaml")
    for candidate in (Path(base), spec_file.parent / base):
        if candidate.is_file():
            return candidate
    raise ValueError(f"{kind} base: {base} not found (relative paths are tried from the current "
                     f"directory, then from {spec_file.parent})")
