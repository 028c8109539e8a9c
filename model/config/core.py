"""The config machinery every config of the repository shares (model, train, rl).

A config is a frozen dataclass deriving from `Config`: it validates on construction, naming the
bad field in one line (`train.lr: must be a positive number, got -1`). Run files are YAML read
with `read_yaml`, changed by dotted `key=value` overrides (`apply_overrides`) and turned into
configs by `build_dataclass`, which rejects unknown keys by name; `config_to_dict` goes back.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping, Sequence

import yaml


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as `1e-5` and `5e6` (YAML 1.1, and so
    PyYAML, would read them as strings) and refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """YAML would keep the last of two equal keys, so a setting written twice (the first
        one then silently ignored) is an error naming both lines. Keys merged in with `<<:`
        may still be overridden, as YAML means them to be."""
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first on line {seen[key] + 1}); "
                    "keep one", key_node.start_mark)
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+"
               r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)


def yaml_problem(err: yaml.YAMLError) -> str:
    """One line for a YAML error: what is wrong and its line, without PyYAML's source excerpt."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(err).split())


# ---- validation ---------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A bad config value. `field`: its dotted name ('' for the config as a whole)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}" if field else problem)
        self.field, self.problem = field, problem

    def within(self, section: str) -> ConfigError:
        """The same error as named from the config that holds this one at `section`."""
        if not section:
            return self
        return ConfigError(f"{section}.{self.field}" if self.field else section, self.problem)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _not_finite(value: Any) -> bool:
    """A float NaN or +-inf, also inside lists, tuples and mappings."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return any(_not_finite(v) for v in value)
    if isinstance(value, Mapping):
        return any(_not_finite(v) for v in value.values())
    return False


def check_choice(field: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(field, f"got {value!r}, allowed values are {list(allowed)}")


def check_positive(field: str, value: Any) -> None:
    if not _is_number(value) or value <= 0:
        raise ConfigError(field, f"must be a positive number, got {value!r}")


def check_nonnegative(field: str, value: Any) -> None:
    if not _is_number(value) or value < 0:
        raise ConfigError(field, f"must be a number >= 0, got {value!r}")


def check_fraction(field: str, value: Any) -> None:
    if not _is_number(value) or not 0 <= value <= 1:
        raise ConfigError(field, f"must be a number in [0, 1], got {value!r}")


def check_open_fraction(field: str, value: Any) -> None:
    """A share that must leave both parts non-empty, e.g. a held-out fraction."""
    if not _is_number(value) or not 0 < value < 1:
        raise ConfigError(field, f"must be a number strictly between 0 and 1, got {value!r}")


def check_bool(field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(field, f"must be true or false, got {value!r}")


def check_int(field: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(field, f"must be an integer >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Base of every config dataclass: frozen and validated on construction.

    `validate` names fields relative to the config itself (`lr`, `muon.steps`) and raises
    `ConfigError`; the error then gets the class's `section`, its place in a run YAML (`train`,
    `moe`). A class used at several places (full/SWA attention, actor/critic optimizer) has no
    section: `build_dataclass` names its fields by the path it builds.
    """

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        # Fields left None that take a value derived from the others (`derived_defaults`): set
        # here, and remembered so that a config built on this one as its default derives them
        # again (`given_values`) instead of inheriting this one's derived values.
        derived = {k: v for k, v in self.derived_defaults().items() if getattr(self, k) is None}
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_derived", tuple(derived))
        try:
            self._check_finite()
            self.validate()
        except ConfigError as err:
            raise err.within(self.section) from None

    def derived_defaults(self) -> dict[str, Any]:
        """{field: value} for fields whose default depends on other fields (given as None)."""
        return {}

    def given_values(self) -> dict[str, Any]:
        """The fields as given, nested configs as dicts, derived defaults left out."""
        return {f.name: given_values(v) for f in dataclasses.fields(self)
                if f.name not in self._derived
                for v in [getattr(self, f.name)]}

    def validate(self) -> None:
        """Raises `ConfigError` for the first bad field; field groups extend it with super()."""

    def _check_finite(self) -> None:
        """No field holds NaN or an infinity (YAML's `.nan`, `.inf`): every range check would
        let NaN through (all its comparisons are false), and a run would train on it."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if _not_finite(value):
                raise ConfigError(field.name, f"must be a finite number, got {value!r}")


# ---- dicts <-> configs --------------------------------------------------------------------------


def build_dataclass(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    """Builds dataclass `cls` from a nested mapping, rejecting unknown keys by name.
    `prefix`: the dotted path of `values` in the run YAML ('' or ending in '.')."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in fields:
            raise ValueError(f"{name}: unknown config field"
                             f"{did_you_mean(key, dotted_names(cls), prefix)}; known fields"
                             f"{' of ' + prefix.rstrip('.') if prefix else ''}: {sorted(fields)}")
        default = fields[key].default
        if dataclasses.is_dataclass(default):
            if not isinstance(value, Mapping):
                raise ValueError(f"{name}: expected a mapping of sub-fields, got {value!r}")
            merged = given_values(default)
            merged.update(value)
            kwargs[key] = build_dataclass(type(default), merged, f"{name}.")
        elif isinstance(value, list):
            kwargs[key] = tuple(value)
        else:
            kwargs[key] = value
    try:
        return cls(**kwargs)
    except ConfigError as err:
        section, path = getattr(cls, "section", ""), prefix.rstrip(".")
        if not section:
            raise err.within(path) from None
        # Named by the section it has on its own (`moe.top_k`): renamed to where it sits in
        # what the user wrote (`model.moe.top_k` in a run YAML).
        if err.field == section or err.field.startswith(f"{section}."):
            raise ConfigError(path + err.field[len(section):], err.problem) from None
        raise


def dotted_names(cls: type, prefix: str = "") -> list[str]:
    """Every field of dataclass `cls` and of the configs nested in it, by dotted name after
    `prefix` (`dotted_names(ModelConfig, "model.")` holds `model.moe.top_k`)."""
    names = []
    for field in dataclasses.fields(cls):
        names.append(f"{prefix}{field.name}")
        if dataclasses.is_dataclass(field.default):
            names += dotted_names(type(field.default), f"{prefix}{field.name}.")
    return names


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
    """` (did you mean 'x'?)` for the known name closest to a mistyped `name` (difflib's
    similarity, as Python's own NameError hints), or '' when none is close. Both are compared
    below `prefix` (a shared `model.` would make any two names look alike); `x` has it."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""


def given_values(value: Any) -> Any:
    """`Config.given_values` of a config, `dataclasses.asdict` of another dataclass, any other
    value as it is."""
    if isinstance(value, Config):
        return value.given_values()
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def config_to_dict(config: Any) -> dict:
    """Nested plain-python dict of a config (round-trips through `build_dataclass`)."""
    return dataclasses.asdict(config)


class _ConfigDumper(yaml.SafeDumper):
    """Mappings as blocks (one field a line), lists inline (`swiglu_limits: [0.0, 7.0]`)."""


_ConfigDumper.add_representer(list, lambda dumper, value: dumper.represent_sequence(
    "tag:yaml.org,2002:seq", value, flow_style=True))


def config_yaml(values: Mapping[str, Any], comment: str = "") -> str:
    """YAML of nested config values (tuples written as lists) that `read_yaml` reads back
    equal, fields in their declared order; `comment` heads it as `# ...` lines."""
    plain = json.loads(json.dumps(values))  # tuples -> lists, and nothing YAML cannot hold
    text = yaml.dump(plain, Dumper=_ConfigDumper, sort_keys=False, width=100)
    return "".join(f"# {line}\n" for line in comment.splitlines()) + text


# ---- YAML files and dotted overrides ------------------------------------------------------------


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"config file {str(path)!r} is a directory; expected a YAML file such "
                         "as configs/tiny.yaml")
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        values = yaml_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {yaml_problem(err)}"
                         ) from None
    if not isinstance(values, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of fields")
    return values


def parse_override(override: str) -> tuple[str, Any]:
    """`"moe.top_k=4"` -> `("moe.top_k", 4)`; values are parsed as YAML (numbers, bools, lists)."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"override {override!r}: expected key=value, e.g. d_model=128")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ValueError(f"override {override!r}: cannot parse value: {yaml_problem(err)}"
                         ) from None
    return key, value


def apply_overrides(values: dict, overrides: Sequence[str]) -> dict:
    """A copy of the nested `values` with each `key.sub=value` override applied in order."""
    values = _deep_copy(values)
    for override in overrides:
        key, value = parse_override(override)
        _set_dotted(values, key, value)
    return values


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ValueError(f"{key}: {part!r} is not a group of fields")
        node = child
    node[parts[-1]] = value


def _deep_copy(values: Mapping[str, Any]) -> dict:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in values.items()}
