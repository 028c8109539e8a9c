"""The config.json checks every checkpoint family's translation starts with (one-line
`CheckpointFormatError`s naming the key)."""

from __future__ import annotations

from typing import Any, Mapping

from model.interop.safetensors_io import CheckpointFormatError


def check_family(hf: Mapping[str, Any], model_type: str,
                 required_values: Mapping[str, tuple]) -> None:
    """`hf` is a config.json of `model_type` whose keys in `required_values` hold one of the
    allowed values (the first is the default when the key is absent)."""
    if hf.get("model_type") != model_type:
        raise CheckpointFormatError(
            f"model_type: expected {model_type!r}, got {hf.get('model_type')!r}")
    for key, allowed in required_values.items():
        if hf.get(key, allowed[0]) not in allowed:
            raise CheckpointFormatError(f"{key}: {hf[key]!r} is not supported "
                                        f"(stepjax implements {allowed[0]!r})")


def required(values: Mapping[str, Any], key: str, prefix: str = "") -> Any:
    """values[key], which config.json must give (not null)."""
    if values.get(key) is None:
        raise CheckpointFormatError(f"{prefix}{key}: missing from config.json")
    return values[key]
