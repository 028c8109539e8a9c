"""Tests of the YAML presets in configs/ and configs/ablation/: each loads and round-trips
through dicts, JSON and YAML text, and the Step 3.5 Flash, MiMo-V2-Flash and ablation presets
match their reports. Pure Python: no JAX compilation."""

from __future__ import annotations

import json

import pytest
import yaml
from tiny_preset import REPO, TINY

from model.config import config_from_dict, config_to_dict, load_config

STEP35 = REPO / "configs" / "step35_flash.yaml"
# Model presets and training runs; RL runs (an `rl:` section, rl/config.py) are tested in
# tests/test_rl_loop.py.
PRESETS = [p for p in sorted((REPO / "configs").glob("*.yaml"))
           + sorted((REPO / "configs" / "ablation").glob("*.yaml"))
           if "rl" not in yaml.safe_load(p.read_text())]


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
    assert cfg.attention_geometry("F").rotary_dims == 64
    assert cfg.attention_geometry("S").rotary_dims == 128
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


def test_deepseek_v4_flash_preset_matches_hugging_face():
    """Against transformers' DeepseekV4Config defaults (V4-Flash's, but for the layout, where
    they give V4-Pro's two leading HCA layers): Flash starts with two sliding-window layers."""
    from transformers import DeepseekV4Config

    hf = DeepseekV4Config()
    cfg = load_config(REPO / "configs" / "deepseek_v4_flash.yaml")
    a, hc, moe = cfg.shared_kv_attention, cfg.hyper_connections, cfg.moe
    assert (cfg.vocab_size, cfg.d_model, cfg.num_layers) == (
        hf.vocab_size, hf.hidden_size, hf.num_hidden_layers)
    assert cfg.layout == "WW" + "CH" * 20 + "C" and cfg.window == hf.sliding_window
    assert (a.num_heads, a.head_dim, a.rope_dims, a.q_lora_rank, a.o_groups, a.o_lora_rank) == (
        hf.num_attention_heads, hf.head_dim, hf.qk_rope_head_dim, hf.q_lora_rank, hf.o_groups,
        hf.o_lora_rank)
    assert (a.rope_theta, a.compress_rope_theta) == (hf.rope_theta, hf.compress_rope_theta)
    assert (a.csa_rate, a.hca_rate) == (hf.compress_rates["compressed_sparse_attention"],
                                        hf.compress_rates["heavily_compressed_attention"])
    assert (a.index_heads, a.index_head_dim, a.index_topk) == (
        hf.index_n_heads, hf.index_head_dim, hf.index_topk)
    assert a.compress_rope_scaling.type == "yarn" and a.compress_rope_scaling.factor == 16
    assert (a.compress_rope_scaling.original_max_len * a.compress_rope_scaling.factor
            == hf.max_position_embeddings)
    assert (hc.hc_mult, hc.sinkhorn_iters, hc.eps) == (
        hf.hc_mult, hf.hc_sinkhorn_iters, hf.hc_eps)
    assert cfg.num_moe_layers == 43 and moe.hash_layers == hf.mlp_layer_types.count("hash_moe")
    assert (moe.num_experts, moe.top_k, moe.expert_hidden, moe.num_shared_experts,
            moe.shared_hidden) == (hf.n_routed_experts, hf.num_experts_per_tok,
                                   hf.moe_intermediate_size, hf.n_shared_experts,
                                   hf.moe_intermediate_size)
    assert moe.router_activation == "sqrt_softplus" and hf.scoring_func == "sqrtsoftplus"
    assert moe.routed_scaling_factor == hf.routed_scaling_factor and moe.renormalize
    assert set(cfg.swiglu_limits) == set(cfg.swiglu_limits_shared) == {hf.swiglu_limit}
    assert cfg.swiglu_gate_clamp == "before_silu" and cfg.norm_eps == hf.rms_norm_eps
    assert (cfg.mtp.num_heads, cfg.mtp.attention_type) == (hf.num_nextn_predict_layers, "W")
    # the release's MTPBlock: a full decoder layer sharing the output head
    assert (cfg.mtp.block, cfg.mtp.share_output_head) == ("layer", True)
    assert cfg.tie_embeddings == hf.tie_word_embeddings


MIMO = REPO / "configs" / "mimo_v2_flash.yaml"


def test_mimo_v2_flash_preset_matches_the_report():
    """MiMo-V2-Flash report, model configuration: 48 layers = 39 SWA + 9 GA, the first layer GA
    with a dense FFN (16384), then 8 hybrid blocks of 5 SWA + 1 GA read as layers 1-4 SWA, 5 GA,
    (5 SWA, GA) x 7; d 4096; 64 query heads on both types, 8 KV heads SWA / 4 GA; Q/K heads of
    192 with 128-dim values, RoPE on the first 64 dims, θ 1e4 SWA / 5e6 GA after the 256k
    extension; window 128 previous tokens (+ the query); sink on SWA; 256 experts top-8 of
    2048, no shared expert; init std 0.006; 3 MTP blocks on SWA with a dense FFN."""
    cfg = load_config(MIMO)
    assert (cfg.num_layers, cfg.d_model, cfg.vocab_size) == (48, 4096, 152576)
    full = [i for i in range(48) if cfg.attention_type(i) == "F"]
    assert full == [0, 5, 11, 17, 23, 29, 35, 41, 47]
    assert set(cfg.layout) == {"F", "S"} and cfg.layout.count("S") == 39
    # the layout's hybrid blocks: after layer 0, every block is five SWA layers and one GA
    assert "SSSSF" == cfg.layout[1:6] and cfg.layout[6:] == "SSSSSF" * 7
    geometry = {t: cfg.attention_geometry(t) for t in "FS"}
    for t, kv_heads, theta, gate in (("F", 4, 5e6, "none"), ("S", 8, 1e4, "sink")):
        g = geometry[t]
        assert (g.num_heads, g.num_kv_heads, g.head_dim, g.v_head_dim) == (64, kv_heads, 192, 128)
        assert (g.rotary_dims, g.rope_theta, g.gate) == (64, theta, gate)
        assert g.rope_scaling.type == "none"
    assert cfg.window == 128 + 1 and not cfg.qk_norm
    assert cfg.value_scale == pytest.approx((4096 / (64 * 128)) ** 0.5, abs=1e-3)
    assert [i for i in range(48) if not cfg.is_moe_layer(i)] == [0] and cfg.dense_hidden == 16384
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.expert_hidden, moe.num_shared_experts) == (
        256, 8, 2048, 0)
    assert (moe.router_activation, moe.router_bias, moe.renormalize) == ("sigmoid", True, True)
    assert (moe.routed_scaling_factor, moe.num_groups, moe.topk_groups) == (1.0, 1, 1)
    assert (cfg.mtp.num_heads, cfg.mtp.attention_type, cfg.mtp.share_output_head) == (3, "S", True)
    assert cfg.init_std == 0.006 and cfg.norm_eps == 1e-5 and not cfg.tie_embeddings


@pytest.mark.parity
def test_mimo_v2_flash_preset_matches_hugging_face():
    """Against transformers' MiMoV2FlashConfig defaults (the release's config) and the layer
    construction of its MiMoV2FlashAttention: SWA layers double the KV heads and alone have
    sinks."""
    from transformers import MiMoV2FlashConfig

    hf = MiMoV2FlashConfig()
    cfg = load_config(MIMO)
    assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.dense_hidden) == (
        hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.intermediate_size)
    kinds = {"full_attention": "F", "sliding_attention": "S"}
    assert cfg.layout == "".join(kinds[t] for t in hf.layer_types)
    assert [cfg.is_moe_layer(i) for i in range(48)] == [t == "sparse" for t in hf.mlp_layer_types]
    assert cfg.window == hf.sliding_window
    for t, hf_type in (("F", "full_attention"), ("S", "sliding_attention")):
        g, rope = cfg.attention_geometry(t), hf.rope_parameters[hf_type]
        kv_heads = hf.num_key_value_heads * (2 if t == "S" else 1)
        assert (g.num_heads, g.num_kv_heads, g.head_dim, g.v_head_dim) == (
            hf.num_attention_heads, kv_heads, hf.head_dim, hf.v_head_dim)
        assert g.rope_theta == rope["rope_theta"]
        assert g.rotary_dims == int(hf.head_dim * rope["partial_rotary_factor"])
        assert (g.gate == "sink") == (t == "S")
    assert cfg.value_scale == hf.attention_value_scale
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.expert_hidden) == (
        hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size)
    assert (moe.routed_scaling_factor, moe.num_groups, moe.topk_groups, moe.renormalize) == (
        hf.routed_scaling_factor, hf.n_group, hf.topk_group, hf.norm_topk_prob)
    assert cfg.norm_eps == hf.rms_norm_eps and cfg.tie_embeddings == hf.tie_word_embeddings
