"""Parity of the DeepSeek-V4 checkpoint family (`model.interop.deepseek_v4`) with transformers'
`DeepseekV4ForCausalLM`: a tiny random transformers model saved with `save_pretrained` imports
into stepjax with the same logits, and a random stepjax model exported with
`save_hf_checkpoint` loads with `from_pretrained` to our logits.

Every parameter or buffer transformers initialises to a constant (sinks, slot biases, mHC biases
and gates, norm weights, router biases, the hash tables) is drawn at random first, so no mapping
hides behind a zero or a one. Sequences of 32 tokens with a window of 8, CSA every 4 (top 3 of up
to 8 entries) and HCA every 4 or 8 tokens make the compressed entries and the indexer's
selection matter; 8 indexer heads keep exact ties of its ReLU scores (which torch.topk and
jax.lax.top_k break differently) out of the way. Only hc_mult 2 and 4 are compared: transformers
builds mHC for any hc_mult, stepjax none at 1 (a plain residual), which the importer refuses.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import config_from_dict
from model.interop.hf import load_hf_checkpoint, save_hf_checkpoint
from model.lm import CausalLM, abstract_variables

VOCAB, D, LENGTH, RTOL = 96, 32, 32, 1e-4
HF_LAYER_TYPES = {"W": "sliding_attention", "C": "compressed_sparse_attention",
                  "H": "heavily_compressed_attention"}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0}


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def tokens(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (2, LENGTH)).astype(np.int64)


def our_logits(config, variables, ids: np.ndarray) -> np.ndarray:
    forward = jax.jit(lambda v, x: CausalLM(config).apply(v, x).logits)
    return np.asarray(forward(variables, jnp.asarray(ids, jnp.int32)))


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


# ---- transformers -> stepjax -------------------------------------------------------------------


def hf_model(layout: str, csa: int, hca: int, hc_mult: int, hash_layers: int, rope: dict,
             seed: int):
    """A tiny float32 DeepseekV4ForCausalLM with every constant-initialised tensor random."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=len(layout),
        layer_types=[HF_LAYER_TYPES[kind] for kind in layout],
        mlp_layer_types=["hash_moe"] * hash_layers + ["moe"] * (len(layout) - hash_layers),
        compress_rates={"compressed_sparse_attention": csa, "heavily_compressed_attention": hca},
        num_attention_heads=4, head_dim=16, q_lora_rank=24, o_groups=2, o_lora_rank=12,
        partial_rotary_factor=0.5, sliding_window=8, index_n_heads=8, index_head_dim=8,
        index_topk=3, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        routed_scaling_factor=1.5, swiglu_limit=0.5, hc_mult=hc_mult, rope_parameters=rope,
        initializer_range=0.1)  # gate/up pre-activations of a few tenths: the clamp acts
    model = DeepseekV4ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "scale")):  # norms, mHC gates: around 1
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(("sinks", "position_bias", "base")):
                p.copy_(torch.randn_like(p))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
            elif name.endswith("tid2eid"):  # distinct experts per token id
                buffer.copy_(torch.stack([torch.randperm(4)[:2] for _ in range(VOCAB)]))
    return model


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("layout, csa, hca, hc_mult, hash_layers, rope", [
    ("WCHC", 4, 8, 2, 1, YARN),
    ("HH", 4, 4, 4, 1, {"rope_type": "default"}),
    ("CW", 4, 8, 4, 2, YARN),
    ("CHWC", 2, 8, 2, 0, {"rope_type": "default"}),
])
def test_a_saved_transformers_model_imports_with_its_logits(tmp_path, layout, csa, hca, hc_mult,
                                                             hash_layers, rope):
    model = hf_model(layout, csa, hca, hc_mult, hash_layers, rope, seed=len(layout) + hc_mult)
    model.save_pretrained(tmp_path / "hf")
    config, variables = load_hf_checkpoint(tmp_path / "hf", progress=False)
    assert (config.layout, config.hyper_connections.hc_mult, config.moe.hash_layers) == (
        layout, hc_mult, hash_layers)
    ids = tokens(seed=csa + hca)
    want = torch_logits(model, ids)
    assert relative_error(our_logits(config, variables, ids), want) < RTOL


# ---- stepjax -> transformers -------------------------------------------------------------------


def our_model(layout: str, hc_mult: int, hash_layers: int, tie: bool, seed: int):
    """A tiny stepjax DeepSeek-V4 model with every leaf random (N(0, 0.1^2) weights; around 1
    for the mHC gates; N(0, 0.2^2) for what stepjax initialises to zero: norm offsets, sinks,
    slot, mHC and router biases), hash tables of distinct experts per token id."""
    config = config_from_dict(dict(
        vocab_size=VOCAB, d_model=D, num_layers=len(layout), layout=layout, window=8,
        num_dense_layers=0, gate="none", tie_embeddings=tie, norm_eps=1e-6,
        shared_kv_attention=dict(
            num_heads=4, head_dim=16, rope_dims=8, q_lora_rank=24, o_groups=2, o_lora_rank=12,
            csa_rate=4, hca_rate=8, index_heads=8, index_head_dim=8, index_topk=3,
            compress_rope_scaling=dict(type="yarn", factor=4.0, original_max_len=16)),
        hyper_connections=dict(hc_mult=hc_mult),
        moe=dict(num_experts=4, top_k=2, expert_hidden=16, shared_hidden=16,
                 router_activation="sqrt_softplus", routed_scaling_factor=1.5,
                 hash_layers=hash_layers, num_ep_groups=1),
        swiglu_limits=0.5, swiglu_limits_shared=0.5, swiglu_gate_clamp="before_silu",
        mtp=dict(num_heads=0)))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if leaf.dtype == jnp.int32:  # tid2eid [layers, vocab, k] of 4 experts
            return np.argsort(rng.random((*leaf.shape[:-1], 4)), axis=-1)[..., :leaf.shape[-1]]
        if name.endswith("scale']"):  # mHC gates (scale, hc_scale)
            return 1 + 0.3 * rng.standard_normal(leaf.shape)
        scale = 0.1 if len(leaf.shape) > 1 else 0.2
        return scale * rng.standard_normal(leaf.shape)

    abstract = nn.meta.unbox(abstract_variables(config))
    return config, jax.tree_util.tree_map_with_path(
        lambda path, leaf: jnp.asarray(draw(path, leaf), leaf.dtype), abstract)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("layout, hc_mult, hash_layers, tie", [
    ("WCHC", 2, 1, False),
    ("CHW", 4, 2, True),
])
def test_an_exported_model_loads_into_transformers_with_our_logits(tmp_path, layout, hc_mult,
                                                                   hash_layers, tie):
    from transformers import DeepseekV4ForCausalLM

    config, variables = our_model(layout, hc_mult, hash_layers, tie, seed=hc_mult)
    save_hf_checkpoint(config, variables, tmp_path / "hf", progress=False)
    model, info = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # every tensor found, none left over
    ids = tokens(seed=7)
    want = our_logits(config, variables, ids)
    assert relative_error(torch_logits(model.float().eval(), ids), want) < RTOL


# ---- the release's own layout -> stepjax -------------------------------------------------------


def release_config(saved: dict) -> dict:
    """save_pretrained's config.json of the WCHC model below in the release's keys: per-layer
    compress ratios (0 / 4 / 128, plus the MTP layer's), the HCA rate 8 as the scalar override,
    the hash layers as a count, the rope dims as a width, YaRN as a flat `rope_scaling`."""
    modern = ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters",
              "partial_rotary_factor", "qk_rope_head_dim")
    return {**{k: v for k, v in saved.items() if k not in modern},
            "compress_ratios": [0, 4, 128, 4, 0], "compress_rate_hca": 8, "num_hash_layers": 1,
            "num_nextn_predict_layers": 1, "qk_rope_head_dim": 8,
            "rope_scaling": {"type": "yarn", **{k: v for k, v in YARN.items()
                                                if k != "rope_type"}}}


@pytest.mark.parity
@pytest.mark.slow
def test_the_release_layout_imports_with_transformers_logits(tmp_path):
    """A saved transformers model rewritten in the release's names and keys loads into
    transformers (its conversion table, its legacy keys) with nothing missing or left over and
    the same logits, and into stepjax with the same variables as save_pretrained's layout."""
    import json

    import test_hf_deepseek_v4_release as release
    from safetensors.numpy import load_file
    from transformers import DeepseekV4ForCausalLM

    model = hf_model("WCHC", 4, 8, 2, 1, YARN, seed=11)
    model.save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    tensors = release.release_names(load_file(tmp_path / "hf" / "model.safetensors"))
    assert "layers.1.attn.compressor.wkv.weight" in tensors and "embed.weight" in tensors
    path = release.write_release_dir(tmp_path / "release", tensors, release_config(saved))

    loaded, info = DeepseekV4ForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    ids = tokens(seed=5)
    want = torch_logits(model, ids)
    np.testing.assert_array_equal(torch_logits(loaded.float().eval(), ids), want)
    config, variables = load_hf_checkpoint(path, progress=False)
    saved_config, saved_variables = load_hf_checkpoint(tmp_path / "hf", progress=False)
    assert config == saved_config and (config.layout, config.shared_kv_attention.hca_rate) == (
        "WCHC", 8)
    got = our_logits(config, variables, ids)
    np.testing.assert_array_equal(got, our_logits(saved_config, saved_variables, ids))
    assert relative_error(got, want) < RTOL
