"""Tests of `model.config`: validation errors name the field, layout shorthand, YAML presets,
dotted overrides and dict round trips. Pure Python: no JAX compilation."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from model.config import (
    ModelConfig,
    config_from_dict,
    config_to_dict,
    expand_layout,
    load_config,
)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
STEP35 = REPO / "configs" / "step35_flash.yaml"
# Model presets and training runs; RL runs (an `rl:` section, rl/config.py) are tested in
# tests/test_rl_loop.py.
PRESETS = [p for p in sorted((REPO / "configs").glob("*.yaml"))
           + sorted((REPO / "configs" / "ablation").glob("*.yaml"))
           if "rl" not in yaml.safe_load(p.read_text())]


def _names_field(message: str, field: str) -> bool:
    """True if `field` appears in `message` as a whole dotted name (not as part of another)."""
    return re.search(rf"(?<![\w.]){re.escape(field)}(?![\w])", message) is not None


def _expect_error(field: str, fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert _names_field(message, field), f"error does not name {field!r}: {message}"
    return message


def _tiny_dict() -> dict:
    """The model section of the tiny preset (the file also holds a `train:` section)."""
    return yaml.safe_load(TINY.read_text())["model"]


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
    cfg = config_from_dict({**_tiny_dict(), "layout": "f + sssf*2"})
    assert cfg.layout == "FSSSFSSSF"
    assert [cfg.attention_type(i) for i in range(9)] == list("FSSSFSSSF")


# ---- validation errors name the field ----------------------------------------------------------


@pytest.mark.parametrize(
    "override, field",
    [
        # GQA: query heads must be whole groups of the KV heads (tiny: num_kv_heads=2)
        ("full_attention.num_heads=3", "full_attention.num_heads"),
        ("swa_attention.num_heads=5", "swa_attention.num_heads"),
        ("num_kv_heads=4", "swa_attention.num_heads"),  # 6 SWA heads not divisible by 4
        ("num_kv_heads=0", "num_kv_heads"),
        ("window=0", "window"),
        ("window=-3", "window"),
        ("moe.top_k=17", "moe.top_k"),  # tiny has 16 experts
        ("moe.top_k=0", "moe.top_k"),
        ("moe.num_experts=0", "moe.num_experts"),
        ("layout=F+SSSF", "layout"),  # 5 layers, num_layers=9
        ("layout=F+SSSF*3", "layout"),  # 13 layers
        ("layout=F+SXSF*2", "layout"),  # unknown char
        ("layout=FSSSFSSSG", "layout"),
        ("layout=F++SSSF*2", "layout"),  # empty term
        ("layout=F+SSSF*", "layout"),  # repeat without count
        ("layout=F+SSSF*0", "layout"),  # zero repeat
        ("layout=F+SSSF*2*1", "layout"),
        ("layout=", "layout"),
        ("gate=gated", "gate"),
        ("attention_impl=flash", "attention_impl"),
        ("moe_impl=dense", "moe_impl"),
        ("remat_policy=everything", "remat_policy"),
        ("compute_dtype=float64", "compute_dtype"),
        ("param_dtype=int8", "param_dtype"),
        ("moe.router_activation=relu", "moe.router_activation"),
        ("full_attention.rope_scaling.type=ntk", "full_attention.rope_scaling.type"),
        ("swa_attention.rope_scaling.type=yarn", "swa_attention.rope_scaling"),
        ("swa_attention.rope_scaling.type=llama3", "swa_attention.rope_scaling"),
        ("swa_attention.rope_scaling.type=bogus", "swa_attention.rope_scaling.type"),
        ("full_attention.rope_scaling={type: yarn, factor: 0}", "full_attention.rope_scaling.factor"),
        ("full_attention.partial_rotary_factor=1.5", "full_attention.partial_rotary_factor"),
        ("full_attention.partial_rotary_factor=-0.25", "full_attention.partial_rotary_factor"),
        ("swa_attention.partial_rotary_factor=2.0", "swa_attention.partial_rotary_factor"),
        # 0.3 * head_dim 32 = 9.6 rotary dims: not whole
        ("full_attention.partial_rotary_factor=0.3", "full_attention.partial_rotary_factor"),
        # 0.5 * head_dim 18 = 9 rotary dims: odd (rotate-half needs pairs)
        ("head_dim=18", "full_attention.partial_rotary_factor"),
        ("swa_attention.partial_rotary_factor=0.15625", "swa_attention.partial_rotary_factor"),  # 5
        ("num_dense_layers=10", "num_dense_layers"),
        ("num_dense_layers=-1", "num_dense_layers"),
        ("moe_layers=[0, 9]", "moe_layers"),  # out of range
        ("moe_layers=[-1]", "moe_layers"),
        ("moe_layers=[2, 2]", "moe_layers"),  # duplicate
        ("moe_layers=[1.5]", "moe_layers"),
        ("swiglu_limits=[0, 7.0]", "swiglu_limits"),  # wrong length
        ("swiglu_limits=-1", "swiglu_limits"),  # negative single number
        ("swiglu_limits_shared=[0, 0, 0, 0, 0, 0, 0, 0, -16.0]", "swiglu_limits_shared"),
        ("swiglu_limits_shared=[1, 2, 3]", "swiglu_limits_shared"),
        ("moe.num_ep_groups=3", "moe.num_ep_groups"),  # 16 experts
        ("moe.num_ep_groups=0", "moe.num_ep_groups"),
        ("d_model=0", "d_model"),
        ("vocab_size=-1", "vocab_size"),
        ("head_dim=0", "head_dim"),
        ("mtp.num_heads=-1", "mtp.num_heads"),
        ("moe.routed_scaling_factor=0", "moe.routed_scaling_factor"),
        ("scan_layers=maybe", "scan_layers"),
        ("norm_eps=0", "norm_eps"),
    ],
)
def test_invalid_override_raises_value_error_naming_the_field(override, field):
    _expect_error(field, load_config, TINY, overrides=[override])


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["foo=1"], "foo"),
        (["moe.topk=2"], "moe.topk"),
        (["full_attention.heads=8"], "full_attention.heads"),
        (["full_attention.rope_scaling.scale=2"], "full_attention.rope_scaling.scale"),
        (["mtp.heads=2"], "mtp.heads"),
    ],
)
def test_unknown_override_field_is_named(overrides, field):
    message = _expect_error(field, load_config, TINY, overrides=overrides)
    assert "unknown" in message


def test_unknown_yaml_fields_are_named(tmp_path):
    top = tmp_path / "top.yaml"
    top.write_text("d_model: 64\ndmodel: 64\n")
    _expect_error("dmodel", load_config, top)
    nested = tmp_path / "nested.yaml"
    nested.write_text("moe: {num_experts: 8, topk: 2}\n")
    _expect_error("moe.topk", load_config, nested)
    deep = tmp_path / "deep.yaml"
    deep.write_text("full_attention: {rope_scaling: {type: yarn, fctor: 2}}\n")
    _expect_error("full_attention.rope_scaling.fctor", load_config, deep)


def test_sub_group_given_a_scalar_is_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("moe: 3\n")
    _expect_error("moe", load_config, path)
    _expect_error("mtp", load_config, TINY, overrides=["mtp=2"])
    # a dotted override through a scalar field
    _expect_error("d_model", load_config, TINY, overrides=["d_model.x=2"])


@pytest.mark.parametrize("override", ["d_model", "=128", "  =1", "d_model=[1, 2", "moe.top_k: 2"])
def test_bad_override_syntax(override):
    with pytest.raises(ValueError) as info:
        load_config(TINY, overrides=[override])
    assert repr(override) in str(info.value)  # the message quotes the offending override


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ValueError) as info:
        load_config(missing)
    assert "nope.yaml" in str(info.value)


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just a string\n", "42\n"])
def test_non_mapping_yaml_is_rejected(tmp_path, text):
    path = tmp_path / "list.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert "list.yaml" in str(info.value)


def test_invalid_yaml_syntax_is_a_value_error(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("d_model: [64\n")
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert "broken.yaml" in str(info.value)


def test_direct_construction_validates_too():
    _expect_error("moe.top_k", ModelConfig, num_layers=1, layout="F", num_dense_layers=0,
                  moe=dataclasses.replace(ModelConfig().moe, num_experts=4, top_k=5, num_ep_groups=1))
    _expect_error("layout", ModelConfig, num_layers=2, layout="FQ")
    _expect_error("window", ModelConfig, window=0)


@pytest.mark.parametrize(
    "changes, field",
    [
        # Wrongly-typed values (e.g. a typo on the command line) must still give a ValueError
        # naming the field (DESIGN.md §2/§6), not a TypeError/AttributeError from deep inside.
        ({"num_layers": "five", "swiglu_limits": [], "swiglu_limits_shared": []}, "num_layers"),
        ({"layout": 5}, "layout"),
        ({"moe_layers": 3}, "moe_layers"),
        ({"swiglu_limits": [1, "x", 0, 0, 0, 0, 0, 0, 0]}, "swiglu_limits"),
        ({"full_attention": {"partial_rotary_factor": "half"}}, "full_attention.partial_rotary_factor"),
    ],
)
def test_wrong_types_raise_value_error_naming_the_field(changes, field):
    values = _tiny_dict()
    for key, value in changes.items():
        if isinstance(value, dict):
            values[key] = {**values.get(key, {}), **value}
        else:
            values[key] = value
    _expect_error(field, config_from_dict, values)


@pytest.mark.parametrize(
    "override, field",
    [
        ("tie_embeddings=flase", "tie_embeddings"),  # a typo must not silently switch tying on
        ("qk_norm=2", "qk_norm"),
        ("moe.router_bias=nope", "moe.router_bias"),
        ("moe.renormalize=ture", "moe.renormalize"),
        ("mtp.share_output_head=yes please", "mtp.share_output_head"),
    ],
)
def test_boolean_fields_reject_non_booleans(override, field):
    # `scan_layers` is checked to be a bool; the other boolean switches must be checked the same
    # way, otherwise any truthy string silently enables them.
    _expect_error(field, load_config, TINY, overrides=[override])


def test_exponent_notation_numbers_are_accepted():
    # PyYAML (YAML 1.1) reads `1e-6` (no dot) as a *string*; a user typing norm_eps=1e-6 or
    # full_attention.rope_theta=5e6 on the command line means the number.
    cfg = load_config(TINY, overrides=["norm_eps=1e-6", "full_attention.rope_theta=5e6"])
    assert cfg.norm_eps == 1e-6
    assert cfg.full_attention.rope_theta == 5e6


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
    path.write_text(yaml.safe_dump({"model": {**_tiny_dict(), "d_model": 96}}))
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


# ---- presets ------------------------------------------------------------------------------------


def test_there_are_presets():
    names = {p.name for p in PRESETS}
    assert {"tiny.yaml", "step35_flash.yaml"} <= names
    assert len([p for p in PRESETS if p.parent.name == "ablation"]) >= 6


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_every_preset_loads_and_round_trips(path):
    cfg = load_config(path)
    assert len(cfg.layout) == cfg.num_layers
    assert config_from_dict(config_to_dict(cfg)) == cfg
    # through JSON and YAML text too (what gets saved next to a checkpoint)
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(config_to_dict(cfg)))) == cfg


def test_round_trip_keeps_non_default_values():
    cfg = load_config(TINY, overrides=["moe_layers=[1, 4]", "gate=sink", "tie_embeddings=true",
                                       "full_attention.rope_scaling={type: yarn, factor: 4.0}",
                                       "mtp.share_output_head=true", "scan_layers=false"])
    values = config_to_dict(cfg)
    assert values["moe_layers"] in ((1, 4), [1, 4])
    assert values["full_attention"]["rope_scaling"]["type"] == "yarn"
    back = config_from_dict(values)
    assert back == cfg
    assert back.full_attention.rope_scaling.factor == 4.0


def test_step35_preset_matches_the_report():
    """Report 2.2 / Table 6: 45 layers (3 dense + 42 MoE), S3F1 with a leading full layer,
    W=512, GQA-8, 64 / 96 query heads, head_dim 128, 288 experts top-8 + 1 shared, 3 MTP heads."""
    cfg = load_config(STEP35)
    assert cfg.num_layers == 45 and cfg.d_model == 4096
    assert cfg.layout == "F" + "SSSF" * 11
    assert cfg.window == 512 and cfg.num_kv_heads == 8 and cfg.head_dim == 128
    assert cfg.full_attention.num_heads == 64 and cfg.swa_attention.num_heads == 96
    assert cfg.full_attention.rotary_dims(cfg.head_dim) == 64
    assert cfg.swa_attention.rotary_dims(cfg.head_dim) == 128
    assert cfg.swa_attention.rope_scaling.type == "none"
    assert [i for i in range(45) if not cfg.is_moe_layer(i)] == [0, 1, 2]
    assert cfg.num_moe_layers == 42
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.num_shared_experts) == (288, 8, 1)
    assert cfg.moe.expert_hidden == 1280 and cfg.dense_hidden == 11264
    assert cfg.moe.routed_scaling_factor == 3.0 and cfg.moe.router_activation == "sigmoid"
    assert cfg.mtp.num_heads == 3
    assert cfg.gate == "headwise"


@pytest.mark.parametrize(
    "name, layout, swa_heads",
    [
        ("30b_a3b_FFFF.yaml", "F" * 48, 32),
        ("30b_a3b_S1F1.yaml", "SF" * 24, 32),
        ("30b_a3b_S3F1.yaml", "SSSF" * 12, 32),
        ("30b_a3b_S3F1_head.yaml", "SSSF" * 12, 48),
    ],
)
def test_30b_layout_ablation_presets(name, layout, swa_heads):
    """Report Table 9 (30B-A3B): 48 layers, d 2048, 1 dense layer, 128 experts top-8, no MTP;
    Table 1: SWA heads 32 (48 for +Head)."""
    cfg = load_config(REPO / "configs" / "ablation" / name)
    assert cfg.layout == layout
    assert cfg.swa_attention.num_heads == swa_heads
    assert (cfg.num_layers, cfg.d_model, cfg.num_dense_layers) == (48, 2048, 1)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.num_shared_experts) == (128, 8, 1)
    assert cfg.mtp.num_heads == 0 and cfg.num_kv_heads == 8 and cfg.window == 512


@pytest.mark.parametrize("name, gate", [("100b_a10b_gate.yaml", "headwise"), ("100b_a10b_sink.yaml", "sink")])
def test_100b_gate_ablation_presets(name, gate):
    """Report Table 9 (100B-A10B): 43 layers, d 4096, 1 dense, 96 experts top-4, partial RoPE off,
    MTP on."""
    cfg = load_config(REPO / "configs" / "ablation" / name)
    assert cfg.gate == gate
    assert (cfg.num_layers, cfg.d_model, cfg.num_dense_layers) == (43, 4096, 1)
    assert (cfg.moe.num_experts, cfg.moe.top_k) == (96, 4)
    assert cfg.full_attention.partial_rotary_factor == 1.0
    assert cfg.swa_attention.partial_rotary_factor == 1.0
    assert cfg.mtp.num_heads >= 1
    assert cfg.layout.count("F") > 0 and cfg.layout.count("S") > 0
