"""DeepSeek-V4's own release layout (`model.interop.deepseek_v4.release_name`,
`deepseek_v4_release_keys`), without torch: the release's config.json keys and unprefixed tensor
names import exactly as transformers' save_pretrained layout of the same tensors does, FP8 /
MXFP4 scales included, and bad names are reported in the files' own layout before any read.

The release-style checkpoint is test_hf_deepseek_v4's hand-written one with its names and keys
rewritten here after transformers' (5.24) reading of the release, written out by hand: its
weight-conversion table for "deepseek_v4" anchors `embed.weight`, `head.weight` and
`hc_head_fn` / `_base` / `_scale` at the start of a name and everything else at `layers.{i}.`,
loading them under the `model.` prefix; `DeepseekV4Config.__post_init__`
folds `compress_ratios`, `compress_rate_*`, `num_hash_layers`, `qk_rope_head_dim` and
`rope_scaling`. The parity test in test_hf_deepseek_v4_parity.py checks that transformers
itself loads such a directory with nothing missing or left over.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import test_hf_deepseek_v4 as v4
import test_hf_quantized as q
from hf_step3p5_checkpoint import assert_same_variables, refusal_before_reads
from safetensors.numpy import save_file

import model.interop.hf as hf
from model.hf import main
from model.interop.deepseek_v4 import config_from_hf
from model.interop.safetensors_io import CheckpointFormatError
from model.weights import load_model

TOP_LEVEL = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
             "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
             "model.hc_head.hc_scale": "hc_head_scale", "head.weight": "head.weight"}
# v4.HF_CONFIG (layers WCHC, CSA 4, HCA 8, one hash layer, rope dims 8 of 16, YaRN on the
# compressed layers) in the release's keys; the ratio list also covers the one MTP layer.
MODERN_KEYS = ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters",
               "partial_rotary_factor", "qk_rope_head_dim")
RELEASE_CONFIG = {
    **{k: v for k, v in v4.HF_CONFIG.items() if k not in MODERN_KEYS},
    "compress_ratios": [0, 4, 128, 4, 0], "compress_rate_hca": 8, "num_hash_layers": 1,
    "qk_rope_head_dim": 8,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}


def release_names(tensors: dict) -> dict:
    """save_pretrained's names -> the release's (MTP tensors are unprefixed in both)."""
    return {TOP_LEVEL.get(name, name.removeprefix("model.")): value
            for name, value in tensors.items()}


def write_release_dir(path, tensors: dict, config: dict):
    """Two shards + index, the embedding and layers 0-1 in the first."""
    path.mkdir(parents=True)
    first = {n for n in tensors if n.startswith(("embed.", "layers.0.", "layers.1."))}
    files = {"model-00001-of-00002.safetensors": first,
             "model-00002-of-00002.safetensors": set(tensors) - first}
    for file, names in files.items():
        save_file({n: tensors[n] for n in sorted(names)}, path / file, metadata={"format": "pt"})
    weight_map = {n: file for file, names in files.items() for n in names}
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": weight_map}  # transformers reads both
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config))
    return path


# ---- config.json -------------------------------------------------------------------------------


def test_the_release_config_keys_give_the_same_model():
    assert v4.architecture(config_from_hf(RELEASE_CONFIG)) == v4.architecture(v4.CFG)
    # the same keys beside transformers' own, where they agree (a flat rope_scaling never
    # equals the nested rope_parameters: refused below)
    both = {**v4.HF_CONFIG, **RELEASE_CONFIG}
    both.pop("rope_scaling")
    assert v4.architecture(config_from_hf(both)) == v4.architecture(v4.CFG)


@pytest.mark.parametrize("change, message", [
    ({"compress_ratios": [0, 4, 8, 4]}, "compress_ratios: [8] not supported"),
    ({"compress_ratios": [0, 4, 128]}, "compress_ratios: expected a list of [4, 5] entries"),
    ({"compress_ratios": [0, 4, 128, 128], "layer_types": v4.HF_CONFIG["layer_types"]},
     "compress_ratios: gives layer_types ["),
    ({"num_hash_layers": 2, "mlp_layer_types": v4.HF_CONFIG["mlp_layer_types"]},
     "num_hash_layers: gives mlp_layer_types ['hash_moe', 'hash_moe', 'moe', 'moe']"),
    ({"num_hash_layers": -1}, "num_hash_layers: expected a count >= 0"),
    ({"rope_parameters": v4.HF_CONFIG["rope_parameters"]}, "rope_scaling: gives rope_parameters"),
    ({"compress_rate_csa": 2, "compress_rates": v4.HF_CONFIG["compress_rates"]},
     "compress_rate_csa: 2 disagrees with compress_rates (4)"),
    ({"qk_rope_head_dim": 4, "partial_rotary_factor": 0.5},
     "qk_rope_head_dim: 4 disagrees with partial_rotary_factor 0.5"),
    ({"rope_scaling": {**RELEASE_CONFIG["rope_scaling"], "truncate": False}},
     "rope_parameters.compress.truncate: not supported"),
    ({"rope_scaling": {**RELEASE_CONFIG["rope_scaling"], "attention_factor": 1.3}},
     "rope_parameters.compress.attention_factor: 1.3 is not supported"),
])
def test_release_keys_stepjax_cannot_honour_are_named(change, message):
    with pytest.raises(CheckpointFormatError) as err:
        config_from_hf({**RELEASE_CONFIG, **change})
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


# ---- tensors -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tensors():
    return v4.hf_tensors()


@pytest.fixture(scope="module")
def saved(tensors, tmp_path_factory):
    """(ModelConfig, variables) of the save_pretrained layout."""
    path = v4.write_hf_dir(tmp_path_factory.mktemp("saved") / "hf", tensors, v4.HF_CONFIG)
    return hf.load_hf_checkpoint(path, progress=False)


def test_the_release_layout_imports_as_the_save_pretrained_layout(tensors, saved, tmp_path):
    path = write_release_dir(tmp_path / "release", release_names(tensors), RELEASE_CONFIG)
    config, variables = hf.load_hf_checkpoint(path, progress=False)
    assert config == saved[0]
    assert_same_variables(saved[1], variables)  # the same numbers: the same logits


def test_a_quantized_release_dequantizes_under_the_release_names(saved, tmp_path):
    """FP8 (`.scale`, U8 e8m0) and MXFP4 experts renamed with their weights; through the CLI."""
    config, quant, stored, plain = q.deepseek_v4_case(np.random.default_rng(0))
    assert config is v4.HF_CONFIG
    assert any(n.startswith("layers.") and n.endswith(".scale") for n in release_names(stored))
    path = write_release_dir(tmp_path / "release", release_names(stored),
                             {**RELEASE_CONFIG, **quant})
    want = hf.load_hf_checkpoint(v4.write_hf_dir(tmp_path / "plain", plain, v4.HF_CONFIG),
                                 progress=False)[1]
    assert main(["import", str(path), "--out", str(tmp_path / "model"), "--dtype", "float32"]) == 0
    assert_same_variables(want, load_model(tmp_path / "model")[1])


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("layers.0.ffn.gate.tid2eid"), "missing tensor: layers.0.ffn.gate.tid2eid"),
    (lambda t: t.update({"layers.1.attn.wo_a.weight": np.zeros((32, 24), np.float32)}),
     "layers.1.attn.wo_a.weight: expected [24, 32], found [32, 24]"),
    (lambda t: t.update({"layers.2.ffn.experts.4.w1.weight": np.zeros((16, 32), np.float32)}),
     "unknown tensor (no stepjax variable): layers.2.ffn.experts.4.w1.weight"),
    (lambda t: t.update({"model.norm.weight": t.pop("norm.weight")}),  # the two layouts mixed
     "unknown tensor (no stepjax variable): model.norm.weight"),
])
def test_bad_release_tensors_are_named_before_any_data_is_read(tensors, tmp_path, monkeypatch,
                                                               change, message):
    renamed = release_names(tensors)
    change(renamed)
    path = write_release_dir(tmp_path / "release", renamed, RELEASE_CONFIG)

    assert message in refusal_before_reads(path, monkeypatch)
