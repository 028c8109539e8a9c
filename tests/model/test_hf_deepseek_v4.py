"""Tests of the DeepSeek-V4 checkpoint family (`model.interop.deepseek_v4`, `deepseek_v4_config`)
without torch: config.json <-> ModelConfig, refusals named by their key or field, tensors landing
in their variables, tensor-exact round trips and bad tensors named before any data is read.

The config.json and the table of tensor names, torch shapes and dtypes are hand-written after
what transformers 5.24's `DeepseekV4ForCausalLM.save_pretrained` writes (the parity tests in
test_hf_deepseek_v4_parity.py check the real thing); expected placements are explicit slices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from hf_step3p5_checkpoint import (
    assert_same_tensors,
    read_dir,
    refusal_before_reads,
    write_hf_dir,
)

import model.interop.hf as hf
from model.interop import deepseek_v4
from model.config import config_from_dict, config_to_dict
from model.interop.deepseek_v4 import config_from_hf, config_to_hf
from model.interop.safetensors_io import CheckpointFormatError
from model.layers.params import convert_layer_layout

VOCAB, D, HEADS, HEAD_DIM, Q_RANK, GROUPS, O_RANK = 64, 32, 4, 16, 24, 2, 12
EXPERTS, HIDDEN, INDEX_HEADS, INDEX_DIM, HC = 4, 16, 2, 8, 2
LAYOUT, CSA, HCA = "WCHC", 4, 8
HF_CONFIG = {  # as transformers 5.24 saves it (DeepseekV4Config.to_json_string)
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
    "compress_rates": {"compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA},
    "compress_rope_theta": 160000.0, "dtype": "bfloat16", "hc_eps": 1e-06, "hc_mult": HC,
    "hc_sinkhorn_iters": 20, "head_dim": HEAD_DIM, "hidden_act": "silu", "hidden_size": D,
    "index_head_dim": INDEX_DIM, "index_n_heads": INDEX_HEADS, "index_topk": 3,
    "initializer_range": 0.02,
    "layer_types": ["sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention"],
    "max_position_embeddings": 1048576, "mlp_bias": False,
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "moe_intermediate_size": HIDDEN,
    "n_routed_experts": EXPERTS, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": HEADS, "num_experts_per_tok": 2, "num_hidden_layers": 4,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": GROUPS,
    "o_lora_rank": O_RANK, "output_router_logits": False, "pad_token_id": None,
    "partial_rotary_factor": 0.5, "q_lora_rank": Q_RANK, "qk_rope_head_dim": 8,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "compress": {"attention_factor": 1.0, "beta_fast": 32, "beta_slow": 1, "factor": 16.0,
                     "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5,
                     "rope_theta": 160000.0, "rope_type": "yarn"},
        "main": {"partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rope_type": "default"}},
    "rope_theta": 10000.0, "routed_scaling_factor": 1.5, "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0, "scoring_func": "sqrtsoftplus", "sliding_window": 8,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "transformers_version": "5.24.0",
    "use_cache": True, "vocab_size": VOCAB,
}
CFG = config_from_dict(dict(
    vocab_size=VOCAB, d_model=D, num_layers=4, layout=LAYOUT, window=8, gate="none",
    num_dense_layers=0, norm_eps=1e-6, tie_embeddings=False,
    shared_kv_attention=dict(
        num_heads=HEADS, head_dim=HEAD_DIM, rope_dims=8, q_lora_rank=Q_RANK, o_groups=GROUPS,
        o_lora_rank=O_RANK, rope_theta=10000.0, compress_rope_theta=160000.0,
        compress_rope_scaling=dict(type="yarn", factor=16.0, original_max_len=64,
                                   beta_fast=32.0, beta_slow=1.0),
        csa_rate=CSA, hca_rate=HCA, index_heads=INDEX_HEADS, index_head_dim=INDEX_DIM,
        index_topk=3),
    hyper_connections=dict(hc_mult=HC, sinkhorn_iters=20, eps=1e-6),
    moe=dict(num_experts=EXPERTS, top_k=2, expert_hidden=HIDDEN, num_shared_experts=1,
             shared_hidden=HIDDEN, router_activation="sqrt_softplus", router_bias=True,
             renormalize=True, routed_scaling_factor=1.5, num_ep_groups=4, hash_layers=1),
    swiglu_limits=10.0, swiglu_limits_shared=10.0, swiglu_gate_clamp="before_silu",
    mtp=dict(num_heads=0, attention_type="W", block="layer", share_output_head=True)))
# What the import of hf_tensors() builds: its one MTP layer.
WITH_MTP = CFG.replace(mtp=dataclasses.replace(CFG.mtp, num_heads=1))
# Keys of a saved config.json that do not describe the network.
RUNTIME_KEYS = {"attention_dropout", "bos_token_id", "eos_token_id", "dtype", "initializer_range",
                "max_position_embeddings", "output_router_logits", "pad_token_id",
                "qk_rope_head_dim", "router_aux_loss_coef", "router_jitter_noise",
                "transformers_version", "use_cache", "num_nextn_predict_layers"}


def architecture(cfg) -> dict:
    values = config_to_dict(cfg)
    for name in ("param_dtype", "compute_dtype", "attention_impl", "moe_impl", "remat_policy",
                 "scan_layers", "init_std", "ep_collective", "pipeline_microbatches",
                 "pipeline_virtual_stages"):
        values.pop(name)
    values["moe"].pop("block_size")
    values["shared_kv_attention"].pop("query_chunk")
    return values


# ---- config.json <-> ModelConfig ---------------------------------------------------------------


def test_config_json_maps_to_the_model_config_and_back():
    assert architecture(config_from_hf(HF_CONFIG)) == architecture(CFG)
    assert architecture(config_from_hf(config_to_hf(CFG))) == architecture(CFG)
    exported = config_to_hf(CFG)
    for key in set(HF_CONFIG) - RUNTIME_KEYS:
        assert exported[key] == HF_CONFIG[key], key
    assert exported["num_nextn_predict_layers"] == 0
    assert config_to_hf(WITH_MTP)["num_nextn_predict_layers"] == 1


def test_the_flat_rope_form_is_nested_as_transformers_does():
    flat = {**HF_CONFIG, "rope_parameters": {"rope_type": "yarn", "factor": 16.0,
                                             "original_max_position_embeddings": 64}}
    assert architecture(config_from_hf(flat)) == architecture(CFG)


@pytest.mark.parametrize("change, field", [
    ({"model_type": "deepseek_v3"}, "model_type"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"num_hash_layers": 2}, "num_hash_layers"),  # the release's key, disagreeing
    ({"hc_mult": 1}, "hc_mult"),
    ({"swiglu_limit": 0.0}, "swiglu_limit"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"layer_types": ["sliding_attention", "full_attention"] * 2}, "layer_types"),
    ({"mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]}, "mlp_layer_types"),
    ({"head_dim": None}, "head_dim"),
    ({"rope_parameters": {**HF_CONFIG["rope_parameters"], "main": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.main.rope_type"),
    ({"rope_parameters": {**HF_CONFIG["rope_parameters"], "compress": {
        **HF_CONFIG["rope_parameters"]["compress"], "attention_factor": 1.277}}},
     "rope_parameters.compress.attention_factor"),
    ({"rope_parameters": {**HF_CONFIG["rope_parameters"], "compress": {
        **HF_CONFIG["rope_parameters"]["compress"], "partial_rotary_factor": 0.25}}},
     "rope_parameters"),
    ({"hc_mult": "four"}, "hc_mult"),  # values of the wrong type, before any arithmetic
    ({"num_hidden_layers": 4.0}, "num_hidden_layers"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),  # per-layer lists would be built
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
])
def test_unsupported_config_values_are_named(change, field):
    with pytest.raises(CheckpointFormatError) as err:
        config_from_hf({**HF_CONFIG, **change})
    message = str(err.value)
    assert message.startswith(f"{field}:") and "\n" not in message


@pytest.mark.parametrize("change, field", [
    (dict(layout="WCHF"), "layout"),
    (dict(num_dense_layers=1), "num_dense_layers"),
    (dict(moe=dataclasses.replace(CFG.moe, num_shared_experts=2)), "moe.num_shared_experts"),
    (dict(moe=dataclasses.replace(CFG.moe, router_activation="softmax")),
     "moe.router_activation"),
    (dict(moe=dataclasses.replace(CFG.moe, router_bias=False)), "moe.router_bias"),
    (dict(swiglu_gate_clamp="after_silu"), "swiglu_gate_clamp"),
    (dict(swiglu_limits_shared=7.0), "swiglu_limits"),
    (dict(hyper_connections=dataclasses.replace(CFG.hyper_connections, hc_mult=1)),
     "hyper_connections.hc_mult"),
    (dict(mtp=dataclasses.replace(CFG.mtp, num_heads=1, block="dense")), "mtp.block"),
    (dict(mtp=dataclasses.replace(CFG.mtp, num_heads=1, share_output_head=False)), "mtp.block"),
])
def test_configs_without_a_deepseek_v4_equivalent_are_not_exported(change, field):
    with pytest.raises(CheckpointFormatError) as err:
        config_to_hf(CFG.replace(**change))
    message = str(err.value)
    assert message.startswith(f"{field}:") and "\n" not in message


# ---- tensors -----------------------------------------------------------------------------------


def hf_tensors(seed: int = 0, mtp: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of HF_CONFIG's checkpoint with its torch shape: bfloat16 weights; float32
    norms (around 1), sinks, slot biases, mHC parameters and router biases; int64 hash tables.
    `mtp`: with the release's MTP layer `mtp.0.*` (a W layer with learned routing, its input
    projections, norms and hc_head), which transformers' save_pretrained does not write."""
    rng = np.random.default_rng(seed)
    n, mix = HC, (2 + HC) * HC
    shapes = {"model.embed_tokens.weight": (VOCAB, D), "model.hc_head.hc_fn": (n, n * D),
              "model.hc_head.hc_base": (n,), "model.hc_head.hc_scale": (1,),
              "model.norm.weight": (D,), "head.weight": (VOCAB, D)}

    def compressor(prefix: str, width: int, rate: int, pair: bool) -> None:
        out = 2 * width if pair else width
        shapes.update({f"{prefix}.wkv.weight": (out, D), f"{prefix}.wgate.weight": (out, D),
                       f"{prefix}.ape": (rate, out), f"{prefix}.norm.weight": (width,)})

    def layer(p: str, kind: str, hashed: bool) -> None:
        shapes.update({
            p + "attn_norm.weight": (D,), p + "ffn_norm.weight": (D,),
            p + "attn.wq_a.weight": (Q_RANK, D), p + "attn.q_norm.weight": (Q_RANK,),
            p + "attn.wq_b.weight": (HEADS * HEAD_DIM, Q_RANK),
            p + "attn.wkv.weight": (HEAD_DIM, D), p + "attn.norm.weight": (HEAD_DIM,),
            p + "attn.wo_a.weight": (GROUPS * O_RANK, HEADS * HEAD_DIM // GROUPS),
            p + "attn.wo_b.weight": (D, GROUPS * O_RANK), p + "attn.attn_sink": (HEADS,),
            p + "ffn.gate.weight": (EXPERTS, D),
            p + "ffn.shared_experts.w1.weight": (HIDDEN, D),
            p + "ffn.shared_experts.w2.weight": (D, HIDDEN),
            p + "ffn.shared_experts.w3.weight": (HIDDEN, D),
        })
        for sub in ("attn", "ffn"):
            shapes.update({f"{p}hc_{sub}_fn": (mix, n * D), f"{p}hc_{sub}_base": (mix,),
                           f"{p}hc_{sub}_scale": (3,)})
        for e in range(EXPERTS):
            shapes.update({f"{p}ffn.experts.{e}.w1.weight": (HIDDEN, D),
                           f"{p}ffn.experts.{e}.w2.weight": (D, HIDDEN),
                           f"{p}ffn.experts.{e}.w3.weight": (HIDDEN, D)})
        shapes[p + ("ffn.gate.tid2eid" if hashed else "ffn.gate.bias")] = (
            (VOCAB, 2) if hashed else (EXPERTS,))
        if kind == "C":
            compressor(p + "attn.compressor", HEAD_DIM, CSA, pair=True)
            compressor(p + "attn.indexer.compressor", INDEX_DIM, CSA, pair=True)
            shapes.update({p + "attn.indexer.wq_b.weight": (INDEX_HEADS * INDEX_DIM, Q_RANK),
                           p + "attn.indexer.weights_proj.weight": (INDEX_HEADS, D)})
        if kind == "H":
            compressor(p + "attn.compressor", HEAD_DIM, HCA, pair=False)

    for i, kind in enumerate(LAYOUT):
        layer(f"model.layers.{i}.", kind, hashed=i == 0)
    if mtp:
        layer("mtp.0.", "W", hashed=False)
        shapes.update({"mtp.0.e_proj.weight": (D, D), "mtp.0.h_proj.weight": (D, D),
                       "mtp.0.enorm.weight": (D,), "mtp.0.hnorm.weight": (D,),
                       "mtp.0.norm.weight": (D,), "mtp.0.hc_head_fn": (n, n * D),
                       "mtp.0.hc_head_base": (n,), "mtp.0.hc_head_scale": (1,)})
    tensors = {}
    for name, shape in shapes.items():
        value = rng.standard_normal(shape)
        if name.endswith("tid2eid"):
            # distinct experts per token id (copied: safetensors writes views' whole buffer)
            tensors[name] = np.argsort(rng.random((VOCAB, EXPERTS)), axis=-1)[:, :2].copy()
        elif name.endswith("norm.weight"):
            tensors[name] = (1 + 0.25 * rng.uniform(-1, 1, shape)).astype(np.float32)
        elif name.endswith(("attn_sink", ".ape", "gate.bias")) or "hc_" in name:
            tensors[name] = value.astype(np.float32)
        else:
            tensors[name] = (0.3 * value).astype(ml_dtypes.bfloat16)
    return tensors


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tensors = hf_tensors()
    return write_hf_dir(tmp_path_factory.mktemp("v4") / "hf", tensors, HF_CONFIG), tensors


def test_imported_tensors_land_in_their_variables(source):
    path, t = source
    config, variables = hf.load_hf_checkpoint(path, progress=False)
    assert architecture(config) == architecture(WITH_MTP)
    per_layer = convert_layer_layout(variables, config, to_scan=False)
    params, balance = per_layer["params"], per_layer["balance"]["layers"]

    def w(name):
        return np.asarray(t[name], np.float32)

    def layer(i):
        return params["layers"][f"layer_{i}"]

    attn, p = layer(1)["self_attn"], "model.layers.1."
    for g in range(GROUPS):  # wo_a: group g's [O_RANK, in] block in turn; ours [g, in, O_RANK]
        np.testing.assert_array_equal(attn["o_a_proj"][g], w(p + "attn.wo_a.weight")[
            g * O_RANK:(g + 1) * O_RANK].T)
        for r in range(O_RANK):
            np.testing.assert_array_equal(attn["o_b_proj"]["kernel"][g, r],
                                          w(p + "attn.wo_b.weight")[:, g * O_RANK + r])
    for h in range(HEADS):
        np.testing.assert_array_equal(attn["q_b_proj"]["kernel"][:, h], w(p + "attn.wq_b.weight")[
            h * HEAD_DIM:(h + 1) * HEAD_DIM].T)
    np.testing.assert_array_equal(attn["kv_norm"]["weight"], w(p + "attn.norm.weight") - 1)
    np.testing.assert_array_equal(attn["compressor"]["kv_proj"],
                                  w(p + "attn.compressor.wkv.weight").T)
    np.testing.assert_array_equal(attn["indexer"]["compressor"]["kv_norm"],
                                  w(p + "attn.indexer.compressor.norm.weight") - 1)
    np.testing.assert_array_equal(attn["indexer"]["weights_proj"],
                                  w(p + "attn.indexer.weights_proj.weight").T)
    for j in range(HC):  # mHC fn: stream j's D columns; ours [n, D, (2+n)n]
        np.testing.assert_array_equal(layer(2)["ffn_hc"]["fn"][j],
                                      w("model.layers.2.hc_ffn_fn")[:, j * D:(j + 1) * D].T)
        np.testing.assert_array_equal(params["hc_head"]["hc_fn"][j],
                                      w("model.hc_head.hc_fn")[:, j * D:(j + 1) * D].T)
    moe = layer(3)["moe"]
    for e in range(EXPERTS):
        for ours, theirs in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3")):
            np.testing.assert_array_equal(moe[ours][e],
                                          w(f"model.layers.3.ffn.experts.{e}.{theirs}.weight").T)
    np.testing.assert_array_equal(balance["layer_3"]["moe"]["router_bias"],
                                  w("model.layers.3.ffn.gate.bias"))
    table = balance["layer_0"]["moe"]["tid2eid"]
    assert table.dtype == np.int32
    np.testing.assert_array_equal(table, t["model.layers.0.ffn.gate.tid2eid"])
    np.testing.assert_array_equal(params["norm"]["weight"], w("model.norm.weight") - 1)
    np.testing.assert_array_equal(params["lm_head"]["kernel"], w("head.weight").T)
    # the MTP layer: its own tensors, and a decoder layer's under mtp.0.
    mtp = params["mtp_0"]
    np.testing.assert_array_equal(mtp["e_proj"]["kernel"], w("mtp.0.e_proj.weight").T)
    np.testing.assert_array_equal(mtp["h_proj"]["kernel"], w("mtp.0.h_proj.weight").T)
    np.testing.assert_array_equal(mtp["hnorm"]["weight"], w("mtp.0.hnorm.weight") - 1)
    for j in range(HC):
        np.testing.assert_array_equal(mtp["hc_head"]["hc_fn"][j],
                                      w("mtp.0.hc_head_fn")[:, j * D:(j + 1) * D].T)
    np.testing.assert_array_equal(mtp["block"]["moe"]["down_proj"][1],
                                  w("mtp.0.ffn.experts.1.w2.weight").T)
    np.testing.assert_array_equal(mtp["block"]["self_attn"]["sinks"], w("mtp.0.attn.attn_sink"))
    np.testing.assert_array_equal(per_layer["balance"]["mtp_0"]["block"]["moe"]["router_bias"],
                                  w("mtp.0.ffn.gate.bias"))


def test_import_then_export_is_tensor_exact(source, tmp_path):
    """bfloat16 weights, float32 norms (exactly w - 1 + 1 for w in [0.5, 2]), mHC and biases,
    int64 hash tables, the MTP layer; under the release's names too."""
    path, tensors = source
    config, variables = hf.load_hf_checkpoint(path, progress=False)
    hf.save_hf_checkpoint(config, variables, tmp_path / "out", dtype="bfloat16", progress=False)
    assert_same_tensors(tensors, read_dir(tmp_path / "out"))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == "deepseek_v4"  # picked from the W/C/H layers
    assert written["num_nextn_predict_layers"] == 1
    hf.save_hf_checkpoint(config, variables, tmp_path / "release", dtype="bfloat16",
                          names="release", progress=False)
    assert_same_tensors({deepseek_v4.release_name(name): a for name, a in tensors.items()},
                        read_dir(tmp_path / "release"))


def test_a_deepseek_v4_model_is_not_exported_as_step3p5(source, tmp_path):
    config, variables = hf.load_hf_checkpoint(source[0], progress=False)
    with pytest.raises(CheckpointFormatError, match="^layout: 'WCHC' has DeepSeek-V4 layers"):
        hf.save_hf_checkpoint(config, variables, tmp_path / "out", model_type="step3p5",
                              progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_sharded_import_writes_each_expert_into_its_shard(source, tmp_path):
    """One tensor per expert: on a data=1 x fsdp=2 x expert=2 x tensor=2 mesh (8 host devices,
    in tests/hf_sharded_import_worker.py) every variable equals the unsharded import, the experts
    split over `expert`."""
    worker = Path(__file__).resolve().parents[1] / "hf_sharded_import_worker.py"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    result = subprocess.run([sys.executable, str(worker), str(source[0]), str(tmp_path / "m")],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    variables = len(jax.tree.leaves(hf.load_hf_checkpoint(source[0], progress=False)[1]))
    assert report["compared"] == {"import": variables, "restored": variables}
    # gate_proj [1, E, D, I] of the CSA layer 1 (segment_1): EXPERTS // 2 experts per shard
    assert report["expert_spec"][1] == "expert"
    assert [shape[1] for shape in report["expert_shard_shapes"]] == [EXPERTS // 2]


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update({"model.layers.1.attn.wo_a.weight": np.zeros((32, 24), np.float32)}),
     "model.layers.1.attn.wo_a.weight: expected [24, 32], found [32, 24]"),
    (lambda t: t.update({"model.layers.0.attn.compressor.ape": np.zeros((4, 32), np.float32)}),
     "unknown tensor (no stepjax variable): model.layers.0.attn.compressor.ape"),
    (lambda t: t.update({"model.layers.2.ffn.experts.4.w1.weight": np.zeros((16, 32))}),
     "unknown tensor (no stepjax variable): model.layers.2.ffn.experts.4.w1.weight"),
    (lambda t: t.pop("model.layers.0.ffn.gate.tid2eid"),
     "missing tensor: model.layers.0.ffn.gate.tid2eid"),
    (lambda t: t.update({"model.layers.0.ffn.gate.tid2eid": np.zeros((64, 2), np.float32)}),
     "model.layers.0.ffn.gate.tid2eid: dtype F32 is not supported"),
    (lambda t: t.pop("mtp.0.e_proj.weight"), "missing tensor: mtp.0.e_proj.weight"),
    (lambda t: t.update({"mtp.1.enorm.weight": t["mtp.0.enorm.weight"]}),
     "num_nextn_predict_layers: 1, but the files hold MTP layers [0, 1]"),
])
def test_bad_tensors_are_named_before_any_data_is_read(source, tmp_path, monkeypatch, change,
                                                        message):
    tensors = dict(source[1])
    change(tensors)
    path = write_hf_dir(tmp_path / "hf", tensors, HF_CONFIG)

    assert message in refusal_before_reads(path, monkeypatch)
