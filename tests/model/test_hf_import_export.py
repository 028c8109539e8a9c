"""Tests of the Hugging Face Step 3.5 checkpoint import/export (`model.interop.hf`): tensor-exact
round trips, the imported weights against a hand-placed model, model variants, and bad inputs
named in one line.

The Hugging Face directory used here is written by the test itself from a hand-written table of
tensor names and torch shapes and a hand-written config.json (tests/hf_step3p5_checkpoint.py,
the published format), never by the exporter under test; the expected stepjax tree is likewise
placed by explicit per-name assignment below.
"""

from __future__ import annotations

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_step3p5_checkpoint import (
    CFG,
    HEAD_DIM,
    HF_CONFIG,
    KV,
    LAYERS,
    MOE_LAYERS,
    MTP_HEADS,
    SHARED_HIDDEN,
    VOCAB,
    D,
    assert_same_tensors,
    assert_same_variables,
    heads,
    read_dir,
    write_hf_dir,
)

from model.config import MTPConfig, QATConfig
from model.interop.hf import load_hf_checkpoint, save_hf_checkpoint
from model.interop.safetensors_io import CheckpointFormatError
from model.layers.params import convert_layer_layout
from model.lm import CausalLM, abstract_variables


def reference_variables(t: dict[str, np.ndarray]) -> dict:
    """Our variables placed by hand from the HF tensors, in the per-layer layout
    (scan_layers=False): kernels are [in, out], attention heads are head-major blocks of
    HEAD_DIM rows of q/k/v_proj, experts [E, out, in] -> [E, in, out]."""

    def w(name):
        return np.asarray(t[name], np.float32)

    def norm(name):
        return {"weight": w(name)}

    def dense(name):
        return {"kernel": w(name).T}

    def block(i):
        p, h = f"model.layers.{i}.", heads(i)
        layer = {
            "input_layernorm": norm(p + "input_layernorm.weight"),
            "post_attention_layernorm": norm(p + "post_attention_layernorm.weight"),
            "self_attn": {
                "q_proj": {"kernel": w(p + "self_attn.q_proj.weight").T.reshape(D, h, HEAD_DIM)},
                "k_proj": {"kernel": w(p + "self_attn.k_proj.weight").T.reshape(D, KV, HEAD_DIM)},
                "v_proj": {"kernel": w(p + "self_attn.v_proj.weight").T.reshape(D, KV, HEAD_DIM)},
                "o_proj": {"kernel": w(p + "self_attn.o_proj.weight").T.reshape(h, HEAD_DIM, D)},
                "g_proj": dense(p + "self_attn.g_proj.weight"),
                "q_norm": norm(p + "self_attn.q_norm.weight"),
                "k_norm": norm(p + "self_attn.k_norm.weight"),
            },
        }
        if i in MOE_LAYERS:
            layer["moe"] = {
                "router": w(p + "moe.gate.weight").T,
                "gate_proj": w(p + "moe.gate_proj.weight").transpose(0, 2, 1),
                "up_proj": w(p + "moe.up_proj.weight").transpose(0, 2, 1),
                "down_proj": w(p + "moe.down_proj.weight").transpose(0, 2, 1),
                "shared_expert": {k: dense(f"{p}share_expert.{k}.weight")
                                  for k in ("gate_proj", "up_proj", "down_proj")},
            }
        else:
            layer["mlp"] = {k: dense(f"{p}mlp.{k}.weight")
                            for k in ("gate_proj", "up_proj", "down_proj")}
        return layer

    params = {
        "embed_tokens": {"embedding": w("model.embed_tokens.weight")},
        "layers": {f"layer_{i}": block(i) for i in range(LAYERS)},
        "norm": norm("model.norm.weight"),
        "lm_head": dense("lm_head.weight"),
    }
    for h in range(MTP_HEADS):
        p = f"model.layers.{LAYERS + h}."
        params[f"mtp_{h}"] = {
            "enorm": norm(p + "enorm.weight"), "hnorm": norm(p + "hnorm.weight"),
            "eh_proj": dense(p + "eh_proj.weight"), "block": block(LAYERS + h),
            "norm": norm(p + "transformer.shared_head.norm.weight"),
            "output_head": dense(p + "transformer.shared_head.output.weight"),
        }
    balance = {"layers": {
        f"layer_{i}": {"moe": {"router_bias": w(f"model.layers.{i}.moe.router_bias")}}
        for i in MOE_LAYERS}}
    return {"params": params, "balance": balance}




def test_an_unknown_model_type_is_named_with_the_known_families(imported, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, "model_type": "llama"}))
    with pytest.raises(ValueError) as err:
        load_hf_checkpoint(tmp_path, progress=False)
    with pytest.raises(ValueError) as export_err:
        save_hf_checkpoint(*imported, tmp_path / "out", model_type="llama", progress=False)
    for message in (str(err.value), str(export_err.value)):
        assert "'llama'" in message and "'step3p5'" in message and "\n" not in message
    assert not (tmp_path / "out").exists()



def test_import_then_export_is_tensor_exact(hf_source, imported, tmp_path):
    hf_dir, _ = hf_source
    config, variables = imported
    save_hf_checkpoint(config, variables, tmp_path / "out", dtype="bfloat16",
                       max_shard_bytes=40_000, progress=False)
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    assert_same_tensors(read_dir(hf_dir), read_dir(tmp_path / "out"))
    # no QAT switch on: config.json records none (model/interop/qat_json.py)
    assert "stepjax_qat" not in json.loads((tmp_path / "out" / "config.json").read_text())


def test_single_file_export_reimports_identically(imported, tmp_path):
    """A QAT switch included: the export records it and the import sets it again."""
    config, variables = imported
    config = config.replace(qat=QATConfig(expert_weights="mxfp4"))
    save_hf_checkpoint(config, variables, tmp_path / "out", progress=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json",
                                                                   "model.safetensors"]
    again, reread = load_hf_checkpoint(tmp_path / "out", progress=False)
    assert again == config
    assert_same_variables(variables, reread)


@pytest.mark.slow
def test_imported_weights_give_the_hand_placed_model(hf_source, imported):
    _, tensors = hf_source
    config, variables = imported
    reference = reference_variables(tensors)
    assert_same_variables(convert_layer_layout(reference, config, to_scan=True), variables)

    forward = jax.jit(lambda v, x: (lambda out: (out.logits, out.mtp_logits))(
        CausalLM(config).apply(v, x)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 16)), jnp.int32)
    logits, mtp_logits = forward(variables, tokens)
    want_logits, want_mtp = forward(convert_layer_layout(reference, config, to_scan=True), tokens)
    np.testing.assert_array_equal(logits, want_logits)
    for got, want in zip(mtp_logits, want_mtp, strict=True):
        np.testing.assert_array_equal(got, want)
    # The comparison is sensitive to the layout: q_proj of layer 1 read without the transpose
    # (a plain reshape of [H*D, d]) changes the logits.
    wrong = reference_variables(tensors)
    q = tensors["model.layers.1.self_attn.q_proj.weight"].astype(np.float32)
    wrong["params"]["layers"]["layer_1"]["self_attn"]["q_proj"]["kernel"] = q.reshape(
        D, 6, HEAD_DIM)
    wrong_logits, _ = forward(convert_layer_layout(wrong, config, to_scan=True), tokens)
    assert np.max(np.abs(np.asarray(wrong_logits) - np.asarray(logits))) > 1e-3


def test_model_variants_export_the_same_network(tmp_path):
    """Tied embeddings, MTP heads sharing the output head, no attention gate, no router bias,
    two shared experts and per-layer (unscanned) params: the re-import has the same weights,
    with the shared output head written out per MTP layer."""
    config = CFG.replace(tie_embeddings=True, gate="none", scan_layers=False,
                         mtp=MTPConfig(num_heads=2, share_output_head=True),
                         moe=dataclasses.replace(CFG.moe, router_bias=False, num_shared_experts=2))
    rng = np.random.default_rng(2)
    variables = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32),
                             nn.meta.unbox(abstract_variables(config)))
    save_hf_checkpoint(config, variables, tmp_path / "hf", progress=False)
    again, reread = load_hf_checkpoint(tmp_path / "hf", progress=False)
    assert (again.moe.num_shared_experts, again.moe.shared_hidden) == (1, 2 * SHARED_HIDDEN)
    assert (again.tie_embeddings, again.gate, again.mtp.share_output_head) == (True, "none", False)
    expected = convert_layer_layout(variables, again, to_scan=True)
    for h in range(2):
        expected["params"][f"mtp_{h}"]["output_head"] = {
            "kernel": variables["params"]["embed_tokens"]["embedding"].T}
    assert_same_variables(expected, reread)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update({"model.layers.3.moe.gate.weight": np.zeros((8, 16), np.float32)}),
     "model.layers.3.moe.gate.weight: expected [8, 32], found [8, 16]"),
    (lambda t: t.pop("model.layers.2.self_attn.g_proj.weight"),
     "missing tensor: model.layers.2.self_attn.g_proj.weight"),
    (lambda t: t.update({"model.layers.2.self_attn.extra.weight": np.zeros((2,), np.float32)}),
     "unknown tensor (no stepjax variable): model.layers.2.self_attn.extra.weight"),
    (lambda t: t.update({"model.norm.weight": np.zeros((D,), np.int32)}),
     "model.norm.weight: dtype I32 is not supported"),
])
def test_bad_tensors_are_named(hf_source, tmp_path, change, message):
    tensors = dict(hf_source[1])
    change(tensors)
    with pytest.raises(CheckpointFormatError) as err:
        load_hf_checkpoint(write_hf_dir(tmp_path / "hf", tensors), progress=False)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_export_never_writes_into_a_non_empty_directory(imported, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match="not empty"):
        save_hf_checkpoint(*imported, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging directory left behind
