"""Tests of `train.config`: every section validates on construction, naming the field by its
place in the run YAML; checks that span sections belong to `RunConfig`. Pure Python."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from model.config import load_config
from train.config import MeshConfig, RunConfig, TrainConfig, load_run_config
from train.optim.config import MuonConfig

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


@pytest.mark.parametrize("make, message", [
    (lambda: TrainConfig(lr=-1), "train.lr: must be a positive number, got -1"),
    (lambda: TrainConfig(log_every=0), "train.log_every: must be an integer >= 1, got 0"),
    (lambda: dataclasses.replace(TrainConfig(), schedule="linear"), "train.schedule: got 'linear'"),
    (lambda: MeshConfig(expert=0), "mesh.expert: must be a positive integer or -1, got 0"),
    (lambda: MeshConfig(data=-1, fsdp=-1), "mesh: at most one axis may be -1"),
    (lambda: MuonConfig(steps=0), "steps: must be an integer >= 1, got 0"),
])
def test_bad_value_raises_on_construction(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("override, message", [
    ("train.lr=-1", "train.lr: must be a positive number, got -1"),
    ("train.muon.steps=0", "train.muon.steps: must be an integer >= 1, got 0"),
    ("train.data.heldout_fraction=1.0", "train.data.heldout_fraction: must be strictly"),
    ("train.xla_cache_dir=3", "train.xla_cache_dir: must be a directory path"),
    ("mesh.zero1=maybe", "mesh.zero1: must be true or false"),
    ("train.seq_len=1", "train.seq_len: must be an integer >= 2, got 1"),
    ("train.min_lr=0.01", "train.min_lr: the cosine decays from train.lr=0.003 down to min_lr"),
])
def test_loaded_sections_name_the_dotted_field(override, message):
    with pytest.raises(ValueError) as info:
        load_run_config(TINY, [override])
    assert str(info.value).startswith(message), str(info.value)


def test_min_lr_above_lr_is_accepted_where_no_cosine_uses_it():
    stages = ["train.schedule=stages", "train.lr_stages=[[10, 1.0e-4, linear]]"]
    assert load_run_config(TINY, ["train.min_lr=0.01", *stages]).train.min_lr == 0.01


def test_mtp_weights_are_checked_against_the_model_by_the_run():
    model = load_config(TINY, ["mtp.num_heads=1"])
    train = TrainConfig(mtp_offset_weights=(1.0, 0.5))  # valid on its own
    with pytest.raises(ValueError, match=r"^train.mtp_offset_weights: 2 weights but the model "
                                         r"has model.mtp.num_heads=1"):
        RunConfig(model=model, train=train)
    assert RunConfig(model=load_config(TINY, ["mtp.num_heads=2"]), train=train).train == train
