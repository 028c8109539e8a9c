"""Model configs from values and files: `config_from_dict` (a `model:` mapping, with the
DeepSeek-V4 attention sizes a mix leaves out scaled to its host), `load_config` (a YAML preset
plus dotted overrides, in the model tools' spelling) and `model_values` (a file's model fields).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

from model.config.attention_config import host_shared_kv_sizes
from model.config.core import apply_overrides, build_dataclass, read_yaml
from model.config.model_config import ModelConfig


def config_from_dict(values: Mapping[str, Any], prefix: str = "") -> ModelConfig:
    """The model of `values` (`prefix`: their dotted place in a run YAML, for errors). A model
    with DeepSeek-V4 attention layers (W / C / H) whose `shared_kv_attention` leaves parameter
    sizes out takes them scaled to its own geometry (`host_shared_kv_sizes`): C layers added
    to the tiny preset stay tiny."""
    if not isinstance(values, Mapping):  # build_dataclass names the section
        return build_dataclass(ModelConfig, values, prefix)
    given = values.get("shared_kv_attention")
    host = build_dataclass(ModelConfig, {k: v for k, v in values.items()
                                         if k != "shared_kv_attention"}, prefix)
    if not host.uses_shared_kv() or not isinstance(given or {}, Mapping):
        return build_dataclass(ModelConfig, values, prefix) if given is not None else host
    derived = host_shared_kv_sizes(given or {}, host.d_model, host.attention_geometry("F"))
    return build_dataclass(ModelConfig, {**values, "shared_kv_attention": {**(given or {}),
                                                                           **derived}}, prefix)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ModelConfig:
    """Loads a YAML preset (its `model:` section if present) and applies dotted overrides
    (`load_config("configs/tiny.yaml", ["d_model=128", "moe.top_k=2"])`). Model fields are
    named without the `model.` prefix that `python -m train` needs (there a run has other
    sections); the prefixed form is refused with the spelling to use."""
    for override in overrides:
        key, _, value = override.partition("=")
        if key.strip().startswith("model."):
            raise ValueError(f"override {override!r}: model tools name model fields without the "
                             f"'model.' prefix; use {key.strip()[len('model.'):]}={value} here")
    return config_from_dict(apply_overrides(model_values(read_yaml(path), path), overrides))


PRESETS_DIR = Path(__file__).resolve().parents[2] / "configs"


def model_values(values: Mapping[str, Any], path: str | Path) -> dict:
    """The model fields of config file `path`, read as `values`: its `model:` section, or the
    file itself for a preset with the fields at top level (configs/step35_flash.yaml). A file
    with neither is refused: the defaults alone are the full-size model, minutes to initialise
    and rarely what an empty or mistyped file meant."""
    model = _model_section(values)
    if not model:
        presets = ", ".join(_shown(p) for p in sorted(PRESETS_DIR.glob("*.yaml"))
                            if _defines_model(p)) or "configs/tiny.yaml"
        raise ValueError(f"config file {str(path)!r} defines no model (no model: section), so it "
                         f"would be the full-size Step 3.5 Flash defaults; start from a preset "
                         f"that has one: {presets}")
    if not isinstance(model, Mapping):
        raise ValueError(f"config file {str(path)!r}: model: expected a mapping of model "
                         f"fields, got {model!r}")
    return dict(model)


def _model_section(values: Mapping[str, Any]) -> Any:
    if "model" in values:
        return values["model"]
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return values if set(values) & model_fields else None


def _defines_model(path: Path) -> bool:
    try:
        return bool(_model_section(read_yaml(path)))
    except ValueError:
        return False


def _shown(path: Path) -> str:
    """`path` relative to the working directory where it lies below it (configs/tiny.yaml)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
