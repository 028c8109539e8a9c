"""Tests of the MiMo-V2-Flash checkpoint family (`model.interop.mimo_v2_flash`,
`mimo_v2_flash_config`) without torch: config.json <-> ModelConfig (transformers' keys and the
original release's), refusals named by their key or field, the export family picked from the
model, tensors landing in their variables, tensor-exact round trips and bad tensors named before
any data is read.

The config.json and the table of tensor names, torch shapes and dtypes are hand-written after
what transformers 5.24's `MiMoV2FlashForCausalLM.save_pretrained` writes (the parity tests in
test_hf_mimo_v2_flash_parity.py check the real thing); expected placements are explicit slices.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

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
from model.config import (
    HyperConnectionConfig,
    RopeScaling,
    config_from_dict,
    config_to_dict,
    load_config,
)
from model.interop.mimo_v2_flash import config_from_hf, config_to_hf
from model.interop.safetensors_io import CheckpointFormatError
from model.layers.params import convert_layer_layout

VOCAB, D, DENSE, HEADS, KV, HEAD_DIM, V_DIM, EXPERTS, HIDDEN = 64, 32, 48, 4, 1, 24, 16, 4, 16
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention"]
MLP_TYPES = ["dense", "sparse", "dense", "sparse", "sparse"]
HF_CONFIG = {  # as transformers 5.24 saves it (MiMoV2FlashConfig.to_json_string)
    "architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash",
    "attention_bias": False, "attention_dropout": 0.0, "attention_value_scale": 0.707,
    "bos_token_id": 1, "dtype": "bfloat16", "eos_token_id": None, "head_dim": HEAD_DIM,
    "hidden_act": "silu", "hidden_size": D, "initializer_range": 0.02,
    "intermediate_size": DENSE, "layer_types": LAYER_TYPES, "max_position_embeddings": 131072,
    "mlp_layer_types": MLP_TYPES, "moe_intermediate_size": HIDDEN, "n_group": 2,
    "n_routed_experts": EXPERTS, "norm_topk_prob": True, "num_attention_heads": HEADS,
    "num_experts_per_tok": 2, "num_hidden_layers": 5, "num_key_value_heads": KV,
    "output_router_logits": False, "pad_token_id": None, "rms_norm_eps": 1e-05,
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.334, "rope_theta": 5000000.0,
                           "rope_type": "default"},
        "sliding_attention": {"partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                              "rope_type": "default"}},
    "routed_scaling_factor": 2.5, "sliding_window": 9, "tie_word_embeddings": False,
    "topk_group": 1, "transformers_version": "5.24.0", "use_cache": True, "v_head_dim": V_DIM,
    "vocab_size": VOCAB,
}
CFG = config_from_dict(dict(
    vocab_size=VOCAB, d_model=D, num_layers=5, layout="FSSFS", window=9, head_dim=HEAD_DIM,
    num_kv_heads=KV, v_head_dim=V_DIM, gate="none", qk_norm=False, value_scale=0.707,
    full_attention=dict(num_heads=HEADS, rope_theta=5e6, partial_rotary_factor=0.334),
    swa_attention=dict(num_heads=HEADS, num_kv_heads=2 * KV, rope_theta=1e4,
                       partial_rotary_factor=0.5, gate="sink"),
    num_dense_layers=0, moe_layers=[1, 3, 4], dense_hidden=DENSE,
    moe=dict(num_experts=EXPERTS, top_k=2, expert_hidden=HIDDEN, num_shared_experts=0,
             router_activation="sigmoid", router_bias=True, renormalize=True,
             routed_scaling_factor=2.5, num_ep_groups=4, num_groups=2, topk_groups=1),
    mtp=dict(num_heads=0), tie_embeddings=False, norm_eps=1e-5))
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# Keys of a saved config.json that do not describe the network.
RUNTIME_KEYS = {"attention_dropout", "bos_token_id", "eos_token_id", "dtype", "initializer_range",
                "max_position_embeddings", "output_router_logits", "pad_token_id",
                "transformers_version", "use_cache"}
# The same network in the original release's keys (its own modelling code's config.json).
RELEASE_CONFIG = {
    **{key: HF_CONFIG[key] for key in (
        "architectures", "model_type", "attention_bias", "attention_value_scale", "head_dim",
        "hidden_act", "hidden_size", "intermediate_size", "moe_intermediate_size", "n_group",
        "n_routed_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok",
        "num_hidden_layers", "num_key_value_heads", "routed_scaling_factor", "topk_group",
        "v_head_dim", "vocab_size")},
    "hybrid_layer_pattern": [0, 1, 1, 0, 1], "moe_layer_freq": [0, 1, 0, 1, 1],
    "swa_num_attention_heads": HEADS, "swa_num_key_value_heads": 2 * KV,
    "swa_head_dim": HEAD_DIM, "swa_v_head_dim": V_DIM, "add_full_attention_sink_bias": False,
    "add_swa_attention_sink_bias": True, "sliding_window_size": 8, "layernorm_epsilon": 1e-5,
    "rope_theta": 5000000.0, "swa_rope_theta": 10000.0, "partial_rotary_factor": 0.334,
    "n_shared_experts": None, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "num_nextn_predict_layers": 1,
}


def architecture(cfg) -> dict:
    values = config_to_dict(cfg)
    for name in ("param_dtype", "compute_dtype", "attention_impl", "moe_impl", "remat_policy",
                 "scan_layers", "init_std", "ep_collective", "pipeline_microbatches",
                 "pipeline_virtual_stages"):
        values.pop(name)
    values["moe"].pop("block_size")
    return values


# ---- config.json <-> ModelConfig ---------------------------------------------------------------


def test_config_json_maps_to_the_model_config_and_back():
    assert architecture(config_from_hf(HF_CONFIG)) == architecture(CFG)
    assert architecture(config_from_hf(config_to_hf(CFG))) == architecture(CFG)
    exported = config_to_hf(CFG)
    for key in set(HF_CONFIG) - RUNTIME_KEYS:
        assert exported[key] == HF_CONFIG[key], key


def test_the_release_keys_read_as_transformers_builds_them():
    """The release's rotary factor is shared by both types: the SWA layers' is 0.334 here."""
    want = CFG.replace(swa_attention=dataclasses.replace(CFG.swa_attention,
                                                         partial_rotary_factor=0.334))
    assert architecture(config_from_hf(RELEASE_CONFIG)) == architecture(want)
    both = {**RELEASE_CONFIG, "layer_types": LAYER_TYPES, "mlp_layer_types": MLP_TYPES,
            "rope_parameters": HF_CONFIG["rope_parameters"], "sliding_window": 9}
    assert architecture(config_from_hf(both)) == architecture(CFG)


def test_absent_layer_lists_and_rope_take_transformers_defaults():
    """Full attention on layer 0 and every sixth layer, the first layer dense, RoPE thetas
    5e6 (full) / 1e4 (SWA) on the leading int(0.334 * 24) = 8 dims."""
    hf_config = {key: value for key, value in HF_CONFIG.items()
                 if key not in ("layer_types", "mlp_layer_types", "rope_parameters")}
    config = config_from_hf({**hf_config, "num_hidden_layers": 7})
    assert (config.layout, config.num_dense_layers, config.moe_layers) == ("FSSSSFS", 1, None)
    full, swa = config.attention_geometry("F"), config.attention_geometry("S")
    assert (full.rope_theta, swa.rope_theta, full.rotary_dims, swa.rotary_dims) == (
        5e6, 1e4, 8, 8)


@pytest.mark.parametrize("change, field", [
    ({"model_type": "mimo_v2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"n_shared_experts": 1}, "n_shared_experts"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"attention_projection_layout": "fused_qkv"}, "attention_projection_layout"),
    ({"add_full_attention_sink_bias": True}, "add_full_attention_sink_bias"),
    ({"add_swa_attention_sink_bias": False}, "add_swa_attention_sink_bias"),
    ({"swa_num_key_value_heads": KV}, "swa_num_key_value_heads"),
    ({"swa_head_dim": 2 * HEAD_DIM}, "swa_head_dim"),
    ({"swa_v_head_dim": HEAD_DIM}, "swa_v_head_dim"),
    ({"swa_num_attention_heads": 2 * HEADS}, "swa_num_attention_heads"),
    ({"layer_types": LAYER_TYPES[:4]}, "layer_types"),
    ({"layer_types": ["chunked_attention"] * 5}, "layer_types"),
    ({"mlp_layer_types": ["moe"] * 5}, "mlp_layer_types"),
    ({"hybrid_layer_pattern": [0, 0, 1, 0, 1]}, "hybrid_layer_pattern"),
    ({"moe_layer_freq": [1, 1, 0, 1, 1]}, "moe_layer_freq"),
    ({"layernorm_epsilon": 1e-6}, "layernorm_epsilon"),
    ({"head_dim": None}, "head_dim"),
    ({"sliding_window": None}, "sliding_window"),
    ({"rope_parameters": {"full_attention": HF_CONFIG["rope_parameters"]["full_attention"]}},
     "rope_parameters.sliding_attention"),
    ({"rope_parameters": {**HF_CONFIG["rope_parameters"], "full_attention": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 5e6}}},
     "rope_parameters.full_attention.rope_type"),
])
def test_unsupported_config_values_are_named(change, field):
    with pytest.raises(CheckpointFormatError) as err:
        config_from_hf({**HF_CONFIG, **change})
    message = str(err.value)
    assert message.startswith(f"{field}:") and "\n" not in message


def swa(**changes):
    return dataclasses.replace(CFG.swa_attention, **changes)


@pytest.mark.parametrize("change, field", [
    (dict(layout="FSWFS"), "layout"),
    (dict(hyper_connections=HyperConnectionConfig(hc_mult=2)), "hyper_connections.hc_mult"),
    (dict(swa_attention=swa(num_heads=2 * HEADS, num_kv_heads=2)), "swa_attention.num_heads"),
    (dict(swa_attention=swa(num_kv_heads=KV)), "swa_attention.num_kv_heads"),
    (dict(swa_attention=swa(head_dim=2 * HEAD_DIM)), "swa_attention.head_dim"),
    (dict(swa_attention=swa(v_head_dim=HEAD_DIM)), "swa_attention.v_head_dim"),
    (dict(gate="sink"), "full_attention.gate"),
    (dict(swa_attention=swa(gate="headwise")), "swa_attention.gate"),
    (dict(swa_attention=swa(gate=None)), "swa_attention.gate"),
    (dict(full_attention=dataclasses.replace(CFG.full_attention, rope_scaling=RopeScaling(
        type="yarn", factor=4.0, original_max_len=64))), "full_attention.rope_scaling"),
    (dict(qk_norm=True), "qk_norm"),
    (dict(moe=dataclasses.replace(CFG.moe, num_shared_experts=1)), "moe.num_shared_experts"),
    (dict(moe=dataclasses.replace(CFG.moe, router_activation="softmax")),
     "moe.router_activation"),
    (dict(moe=dataclasses.replace(CFG.moe, router_bias=False)), "moe.router_bias"),
    (dict(moe=dataclasses.replace(CFG.moe, hash_layers=1)), "moe.hash_layers"),
    (dict(swiglu_limits=7.0), "swiglu_limits"),
    (dict(mtp=dataclasses.replace(CFG.mtp, num_heads=1)), "mtp.num_heads"),
])
def test_configs_without_a_mimo_v2_flash_equivalent_are_not_exported(change, field):
    with pytest.raises(CheckpointFormatError) as err:
        config_to_hf(CFG.replace(**change))
    message = str(err.value)
    assert message.startswith(f"{field}:") and "\n" not in message


def test_the_export_family_follows_the_attention():
    assert hf.model_type_of(CFG) == "mimo_v2_flash"
    assert hf.model_type_of(load_config(CONFIGS / "tiny_mimo.yaml")) == "mimo_v2_flash"
    assert hf.model_type_of(load_config(CONFIGS / "tiny.yaml")) == "step3p5"
    assert hf.model_type_of(load_config(CONFIGS / "tiny_deepseek_v4.yaml")) == "deepseek_v4"


# ---- tensors -----------------------------------------------------------------------------------


def hf_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of HF_CONFIG's checkpoint with its torch shape: bfloat16 weights, norms
    (around 1) and sinks; the float32 router weights and biases. Plus an MTP tensor, which
    transformers (and the import) skip."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, D), "model.norm.weight": (D,),
              "lm_head.weight": (VOCAB, D), "model.mtp.layers.0.enorm.weight": (D,)}
    for i, (kind, mlp) in enumerate(zip(LAYER_TYPES, MLP_TYPES)):
        p, kv = f"model.layers.{i}.", 2 * KV if kind == "sliding_attention" else KV
        shapes.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, D),
            p + "self_attn.k_proj.weight": (kv * HEAD_DIM, D),
            p + "self_attn.v_proj.weight": (kv * V_DIM, D),
            p + "self_attn.o_proj.weight": (D, HEADS * V_DIM)})
        if kind == "sliding_attention":
            shapes[p + "self_attn.attention_sink_bias"] = (HEADS,)
        if mlp == "dense":
            shapes.update({p + "mlp.gate_proj.weight": (DENSE, D),
                           p + "mlp.up_proj.weight": (DENSE, D),
                           p + "mlp.down_proj.weight": (D, DENSE)})
            continue
        shapes.update({p + "mlp.gate.weight": (EXPERTS, D),
                       p + "mlp.gate.e_score_correction_bias": (EXPERTS,)})
        for e in range(EXPERTS):
            shapes.update({f"{p}mlp.experts.{e}.gate_proj.weight": (HIDDEN, D),
                           f"{p}mlp.experts.{e}.up_proj.weight": (HIDDEN, D),
                           f"{p}mlp.experts.{e}.down_proj.weight": (D, HIDDEN)})
    tensors = {}
    for name, shape in shapes.items():
        value = rng.standard_normal(shape)
        if name.endswith("norm.weight"):
            tensors[name] = (1 + 0.25 * rng.uniform(-1, 1, shape)).astype(ml_dtypes.bfloat16)
        elif name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
            tensors[name] = value.astype(np.float32)
        else:
            tensors[name] = (0.3 * value).astype(ml_dtypes.bfloat16)
    return tensors


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tensors = hf_tensors()
    return write_hf_dir(tmp_path_factory.mktemp("mimo") / "hf", tensors, HF_CONFIG), tensors


def test_imported_tensors_land_in_their_variables(source):
    path, t = source
    config, variables = hf.load_hf_checkpoint(path, progress=False)
    assert architecture(config) == architecture(CFG)
    per_layer = convert_layer_layout(variables, config, to_scan=False)
    params, balance = per_layer["params"], per_layer["balance"]["layers"]

    def w(name):
        return np.asarray(t[name], np.float32)

    attn, p = params["layers"]["layer_1"]["self_attn"], "model.layers.1."
    for h in range(HEADS):  # head-major blocks of HEAD_DIM (q, k) / V_DIM (v, o) rows
        np.testing.assert_array_equal(attn["q_proj"]["kernel"][:, h], w(p + "self_attn.q_proj."
                                      "weight")[h * HEAD_DIM:(h + 1) * HEAD_DIM].T)
        np.testing.assert_array_equal(attn["o_proj"]["kernel"][h], w(p + "self_attn.o_proj."
                                      "weight")[:, h * V_DIM:(h + 1) * V_DIM].T)
    for k in range(2 * KV):
        np.testing.assert_array_equal(attn["k_proj"]["kernel"][:, k], w(p + "self_attn.k_proj."
                                      "weight")[k * HEAD_DIM:(k + 1) * HEAD_DIM].T)
        np.testing.assert_array_equal(attn["v_proj"]["kernel"][:, k], w(p + "self_attn.v_proj."
                                      "weight")[k * V_DIM:(k + 1) * V_DIM].T)
    np.testing.assert_array_equal(attn["sink"], w(p + "self_attn.attention_sink_bias"))
    assert "sink" not in params["layers"]["layer_3"]["self_attn"]
    np.testing.assert_array_equal(params["layers"]["layer_2"]["mlp"]["down_proj"]["kernel"],
                                  w("model.layers.2.mlp.down_proj.weight").T)
    np.testing.assert_array_equal(params["layers"]["layer_2"]["input_layernorm"]["weight"],
                                  w("model.layers.2.input_layernorm.weight") - 1)
    moe = params["layers"]["layer_4"]["moe"]
    np.testing.assert_array_equal(moe["router"], w("model.layers.4.mlp.gate.weight").T)
    for e in range(EXPERTS):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            np.testing.assert_array_equal(moe[proj][e],
                                          w(f"model.layers.4.mlp.experts.{e}.{proj}.weight").T)
    np.testing.assert_array_equal(balance["layer_4"]["moe"]["router_bias"],
                                  w("model.layers.4.mlp.gate.e_score_correction_bias"))
    np.testing.assert_array_equal(params["norm"]["weight"], w("model.norm.weight") - 1)
    np.testing.assert_array_equal(params["lm_head"]["kernel"], w("lm_head.weight").T)


def test_import_then_export_is_tensor_exact(source, tmp_path):
    """bfloat16 weights, norms (exactly w - 1 + 1 for w in [0.5, 2]) and sinks, float32 router
    weights and biases; the MTP tensor is dropped as transformers drops it."""
    path, tensors = source
    config, variables = hf.load_hf_checkpoint(path, progress=False)
    hf.save_hf_checkpoint(config, variables, tmp_path / "out", dtype="bfloat16", progress=False)
    expected = {name: a for name, a in tensors.items() if not name.startswith("model.mtp.")}
    assert_same_tensors(expected, read_dir(tmp_path / "out"))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == "mimo_v2_flash"  # picked from the per-type geometry


def test_a_mimo_model_is_not_exported_as_step3p5(source, tmp_path):
    config, variables = hf.load_hf_checkpoint(source[0], progress=False)
    with pytest.raises(CheckpointFormatError, match="^swa_attention.num_kv_heads: per-type"):
        hf.save_hf_checkpoint(config, variables, tmp_path / "out", model_type="step3p5",
                              progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update({"model.layers.1.self_attn.v_proj.weight": np.zeros((24, 32))}),
     "model.layers.1.self_attn.v_proj.weight: expected [32, 32], found [24, 32]"),
    (lambda t: t.update({"model.layers.0.self_attn.attention_sink_bias": np.zeros(4)}),
     "unknown tensor (no stepjax variable): model.layers.0.self_attn.attention_sink_bias"),
    (lambda t: t.update({"model.layers.3.mlp.experts.4.up_proj.weight": np.zeros((16, 32))}),
     "unknown tensor (no stepjax variable): model.layers.3.mlp.experts.4.up_proj.weight"),
    (lambda t: t.update({"model.layers.3.mlp.shared_experts.up_proj.weight": np.zeros((16, 32))}),
     "unknown tensor (no stepjax variable): model.layers.3.mlp.shared_experts.up_proj.weight"),
    (lambda t: t.pop("model.layers.2.self_attn.attention_sink_bias"),
     "missing tensor: model.layers.2.self_attn.attention_sink_bias"),
])
def test_bad_tensors_are_named_before_any_data_is_read(source, tmp_path, monkeypatch, change,
                                                        message):
    tensors = dict(source[1])
    change(tensors)
    path = write_hf_dir(tmp_path / "hf", tensors, HF_CONFIG)

    assert message in refusal_before_reads(path, monkeypatch)
