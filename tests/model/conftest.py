"""Fixtures shared by the model tests: a two-shard Hugging Face checkpoint (and its import) and
the small baseline model. Module-scoped: each test file that uses one builds it once."""

from pathlib import Path

import pytest
from hf_step3p5_checkpoint import random_tensors, write_hf_dir
from small_lm import baseline

from model.interop.hf import load_hf_checkpoint


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory) -> tuple[Path, dict]:
    """(directory of a random-weight two-shard step3p5 checkpoint, its tensors by name)."""
    tensors = random_tensors()
    return write_hf_dir(tmp_path_factory.mktemp("hf"), tensors), tensors


@pytest.fixture(scope="module")
def imported(hf_source):
    """(ModelConfig, variables) of `hf_source` as `load_hf_checkpoint` returns them."""
    return load_hf_checkpoint(hf_source[0], progress=False)


@pytest.fixture(scope="module")
def base():
    """The small baseline model of `small_lm` (cached per process)."""
    return baseline()
