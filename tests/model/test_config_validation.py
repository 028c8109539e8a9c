"""Tests of `model.config` validation: every invalid value, unknown field, wrong type, bad
override syntax or unreadable file raises a ValueError naming the field (or the file). Pure
Python: no JAX compilation."""

from __future__ import annotations

import dataclasses
import re

import pytest
from tiny_preset import TINY, tiny_model_dict

from model.config import ModelConfig, config_from_dict, load_config


def _names_field(message: str, field: str) -> bool:
    """True if `field` appears in `message` as a whole dotted name (not as part of another)."""
    return re.search(rf"(?<![\w.]){re.escape(field)}(?![\w])", message) is not None


def _expect_error(field: str, fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert _names_field(message, field), f"error does not name {field!r}: {message}"
    return message


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
        # int(0.3 * head_dim 32) = 9 rotary dims: odd
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
    # sub-configs validate on construction too, naming their place in the run YAML
    _expect_error("moe.top_k", dataclasses.replace, ModelConfig().moe, num_experts=4, top_k=5,
                  num_ep_groups=1)
    _expect_error("mtp.num_heads", dataclasses.replace, ModelConfig().mtp, num_heads=-1)
    _expect_error("num_heads", dataclasses.replace, ModelConfig().full_attention, num_heads=0)
    _expect_error("full_attention.num_heads", ModelConfig, num_kv_heads=8,
                  full_attention=dataclasses.replace(ModelConfig().full_attention, num_heads=12))
    _expect_error("layout", ModelConfig, num_layers=2, layout="FQ")
    _expect_error("window", ModelConfig, window=0)


@pytest.mark.parametrize(
    "changes, field",
    [
        # Wrongly-typed values (e.g. a typo on the command line) must still give a ValueError
        # naming the field (docs/architecture.md), not a TypeError/AttributeError from deep inside.
        ({"num_layers": "five", "swiglu_limits": [], "swiglu_limits_shared": []}, "num_layers"),
        ({"layout": 5}, "layout"),
        ({"moe_layers": 3}, "moe_layers"),
        ({"swiglu_limits": [1, "x", 0, 0, 0, 0, 0, 0, 0]}, "swiglu_limits"),
        ({"full_attention": {"partial_rotary_factor": "half"}}, "full_attention.partial_rotary_factor"),
    ],
)
def test_wrong_types_raise_value_error_naming_the_field(changes, field):
    values = tiny_model_dict()
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


TINY_MIMO = TINY.parent / "tiny_mimo.yaml"


@pytest.mark.parametrize(
    "override, field",
    [
        # MiMo-V2-Flash's per-type geometry (tiny_mimo: 8 heads per type, 1 KV head full / 2
        # SWA, Q/K head 48, V head 32, partial_rotary_factor 0.334) and group-limited routing.
        ("swa_attention.num_kv_heads=3", "swa_attention.num_kv_heads"),  # 8 % 3
        ("swa_attention.num_heads=5", "swa_attention.num_kv_heads"),  # 5 % its own 2
        ("num_kv_heads=3", "full_attention.num_heads"),  # the model's, used by F only
        ("full_attention.num_kv_heads=0", "full_attention.num_kv_heads"),
        ("swa_attention.num_kv_heads=two", "swa_attention.num_kv_heads"),
        ("swa_attention.head_dim=40", "swa_attention.partial_rotary_factor"),  # int(13.36) odd
        ("head_dim=47", "full_attention.partial_rotary_factor"),  # int(15.7): odd
        ("full_attention.head_dim=0", "full_attention.head_dim"),
        ("swa_attention.head_dim=1.5", "swa_attention.head_dim"),
        ("swa_attention.v_head_dim=0", "swa_attention.v_head_dim"),
        ("v_head_dim=0", "v_head_dim"),
        ("v_head_dim=wide", "v_head_dim"),
        ("swa_attention.gate=sinks", "swa_attention.gate"),
        ("full_attention.gate=7", "full_attention.gate"),
        ("gate=sinks", "gate"),
        ("value_scale=0", "value_scale"),
        ("value_scale=-0.7", "value_scale"),
        ("value_scale=big", "value_scale"),
        ("moe.num_groups=3", "moe.num_groups"),  # 16 experts
        ("moe.num_groups=0", "moe.num_groups"),
        ("moe.topk_groups=5", "moe.topk_groups"),  # num_groups 1
        ("moe.topk_groups=0", "moe.topk_groups"),
        ("moe.num_groups=8", "moe.top_k"),  # top-4 within 1 group of 2 experts
    ],
)
def test_invalid_mimo_geometry_and_groups_name_the_field(override, field):
    _expect_error(field, load_config, TINY_MIMO, overrides=[override])


def test_mimo_geometry_resolves_per_type():
    cfg = load_config(TINY_MIMO, overrides=["moe.num_groups=4", "moe.topk_groups=2"])
    full, swa = cfg.attention_geometry("F"), cfg.attention_geometry("S")
    assert (full.num_heads, full.num_kv_heads, full.head_dim, full.v_head_dim) == (8, 1, 48, 32)
    assert (swa.num_heads, swa.num_kv_heads, swa.head_dim, swa.v_head_dim) == (8, 2, 48, 32)
    assert full.rotary_dims == swa.rotary_dims == 16  # int(0.334 * 48)
    assert (full.gate, swa.gate) == ("none", "sink")
    assert (cfg.moe.num_groups, cfg.moe.topk_groups) == (4, 2)
