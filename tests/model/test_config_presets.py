"""Tests of the YAML presets in configs/ and configs/ablation/: each loads and round-trips
through dicts, JSON and YAML text, and the Step 3.5 Flash and ablation presets match the report.
Pure Python: no JAX compilation."""

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
    assert cfg.tie_embeddings == hf.tie_word_embeddings
