"""Tests of `model.config` layout shorthand (`F+SSSF*11`) and dotted overrides of the public
keys on top of a YAML preset. Pure Python: no JAX compilation."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from tiny_preset import TINY, tiny_model_dict

from model.config import ModelConfig, config_from_dict, expand_layout, load_config

# ---- layout shorthand ---------------------------------------------------------------------------


def test_step35_layout_shorthand_expands_to_45_layers_full_every_fourth():
    layout = expand_layout("F+SSSF*11")
    assert len(layout) == 45
    for i, char in enumerate(layout):
        assert char == ("F" if i % 4 == 0 else "S"), i


@pytest.mark.parametrize(
    "shorthand, expected",
    [
        ("SF*24", "SF" * 24),
        ("F*3", "FFF"),
        ("FS*2+F", "FSFSF"),
        ("F+SSSF*2", "FSSSFSSSF"),
        (" f + sssf * 2 ", "FSSSFSSSF"),  # spaces and lower case are accepted
        ("s+S*2+fs", "SSSFS"),
        ("F+SSSF*10+SS", "F" + "SSSF" * 10 + "SS"),
    ],
)
def test_layout_shorthand(shorthand, expected):
    assert expand_layout(shorthand) == expected


def test_config_stores_the_expanded_layout():
    cfg = config_from_dict({**tiny_model_dict(), "layout": "f + sssf*2"})
    assert cfg.layout == "FSSSFSSSF"
    assert [cfg.attention_type(i) for i in range(9)] == list("FSSSFSSSF")


# ---- overrides of the public dotted keys --------------------------------------------------------


def _with(cfg: ModelConfig, key: str, value):
    """Independent expectation: `cfg` with dotted `key` replaced via dataclasses.replace."""
    head, _, rest = key.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: _with(getattr(cfg, head), rest, value)})


@pytest.mark.parametrize(
    "key, text, value",
    [
        ("d_model", "96", 96),
        ("vocab_size", "1000", 1000),
        ("window", "8", 8),
        ("gate", "sink", "sink"),
        ("gate", "none", "none"),
        ("head_dim", "16", 16),
        ("num_kv_heads", "1", 1),
        ("full_attention.num_heads", "8", 8),
        ("swa_attention.num_heads", "4", 4),
        ("num_dense_layers", "2", 2),
        ("moe.num_experts", "8", 8),
        ("moe.top_k", "2", 2),
        ("moe.expert_hidden", "48", 48),
        ("mtp.num_heads", "1", 1),
        ("mtp.num_heads", "0", 0),
        ("attention_impl", "cudnn", "cudnn"),
        ("moe_impl", "ragged_dot", "ragged_dot"),
        ("compute_dtype", "bfloat16", "bfloat16"),
        ("remat_policy", "dots", "dots"),
        ("scan_layers", "false", False),
    ],
)
def test_override_changes_exactly_that_field(key, text, value):
    base = load_config(TINY)
    cfg = load_config(TINY, overrides=[f"{key}={text}"])
    assert cfg == _with(base, key, value)


def test_override_layout_and_num_layers_together():
    cfg = load_config(TINY, overrides=["num_layers=5", "layout=F+SSSF", "swiglu_limits=0",
                                       "swiglu_limits_shared=[0, 0, 0, 0, 16]"])
    assert cfg.num_layers == 5
    assert cfg.layout == "FSSSF"
    assert cfg.swiglu_limits == (0.0,) * 5
    assert cfg.swiglu_limits_shared == (0.0, 0.0, 0.0, 0.0, 16.0)
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False, True, True, True, True]
    cfg = load_config(TINY, overrides=["layout=SF*4+S"])
    assert cfg.layout == "SFSFSFSFS"


def test_later_override_wins_and_file_is_not_modified():
    before = TINY.read_text()
    cfg = load_config(TINY, overrides=["moe.top_k=2", "moe.top_k=3"])
    assert cfg.moe.top_k == 3
    assert cfg.moe.num_experts == 16  # sibling fields of the group are kept
    assert TINY.read_text() == before


def test_nested_override_keeps_yaml_siblings():
    cfg = load_config(TINY, overrides=["full_attention.num_heads=8"])
    assert cfg.full_attention.num_heads == 8
    assert cfg.full_attention.partial_rotary_factor == 0.5  # from tiny.yaml
    assert cfg.full_attention.rope_theta == 10000.0


def test_model_section_is_used(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {**tiny_model_dict(), "d_model": 96}}))
    cfg = load_config(path, overrides=["moe.top_k=2"])
    assert cfg.d_model == 96 and cfg.moe.top_k == 2


def test_moe_layers_and_per_layer_limits():
    cfg = load_config(TINY, overrides=["moe_layers=[0, 3, 8]"])
    assert cfg.moe_layers == (0, 3, 8)
    assert [i for i in range(9) if cfg.is_moe_layer(i)] == [0, 3, 8]
    assert cfg.num_moe_layers == 3
    cfg = load_config(TINY, overrides=["swiglu_limits=2.5"])
    assert cfg.swiglu_limits == (2.5,) * 9
    default = load_config(TINY, overrides=["num_dense_layers=3"])
    assert [i for i in range(9) if default.is_moe_layer(i)] == [3, 4, 5, 6, 7, 8]
