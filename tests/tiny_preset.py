"""configs/tiny.yaml and its `model:` section, shared by the tests/model/test_config_*.py files."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


def tiny_model_dict() -> dict:
    """The model section of the tiny preset (the file also holds a `train:` section)."""
    return yaml.safe_load(TINY.read_text())["model"]
