"""Parity of MiMo-V2-Flash's attention and router pieces with transformers'
`mimo_v2_flash` (torch, float64): the `Attention` layer on a full and a sliding-window layer
(per-type KV heads 1 / 2, Q/K heads of 48 dims with 32-dim values, partial RoPE on int(0.334 *
48) = 16 dims, value scale 0.707, the sink on SWA only) against `MiMoV2FlashAttention` with the
mask built from transformers' own mask functions (`kv_idx > q_idx - sliding_window`); and
group-limited routing against `MiMoV2FlashTopkRouter`. Sinks and router biases, constant at
init in both, are drawn at random."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_references import assert_close

from model.config import AttentionTypeConfig, ModelConfig, MoEConfig, MTPConfig
from model.layers.attention import Attention
from model.layers.router import route

pytestmark = pytest.mark.parity

D_MODEL, HEADS, QK_DIM, V_DIM, WINDOW, LENGTH = 32, 4, 48, 32, 7, 40
HF_TYPES = {"F": "full_attention", "S": "sliding_attention"}
ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 640_000.0,
                           "partial_rotary_factor": 0.334},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0,
                              "partial_rotary_factor": 0.334}}


def hf_config(**changes):
    from transformers import MiMoV2FlashConfig

    values = dict(vocab_size=64, hidden_size=D_MODEL, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=1, head_dim=QK_DIM,
                  v_head_dim=V_DIM, sliding_window=WINDOW, attention_value_scale=0.707,
                  layer_types=["full_attention", "sliding_attention"],
                  mlp_layer_types=["dense", "dense"], rope_parameters=ROPE,
                  moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4)
    config = MiMoV2FlashConfig(**{**values, **changes})
    config._attn_implementation = "eager"
    return config


def our_config():
    return ModelConfig(
        vocab_size=64, d_model=D_MODEL, num_layers=2, layout="FS", window=WINDOW,
        head_dim=QK_DIM, num_kv_heads=1, v_head_dim=V_DIM, gate="none", qk_norm=False,
        value_scale=0.707,
        full_attention=AttentionTypeConfig(num_heads=HEADS, rope_theta=640_000.0,
                                           partial_rotary_factor=0.334),
        swa_attention=AttentionTypeConfig(num_heads=HEADS, num_kv_heads=2, rope_theta=10_000.0,
                                          partial_rotary_factor=0.334, gate="sink"),
        num_dense_layers=2, dense_hidden=64, mtp=MTPConfig(num_heads=0))


@pytest.mark.parametrize("attention_type", ["F", "S"])
def test_attention_layer_matches_transformers(attention_type):
    import torch
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import (
        MiMoV2FlashAttention,
        MiMoV2FlashRotaryEmbedding,
    )

    torch.manual_seed(0)
    config = hf_config()
    layer = {"F": 0, "S": 1}[attention_type]
    theirs = MiMoV2FlashAttention(config, layer).double().eval()
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            param.copy_(torch.randn(param.shape, dtype=torch.float64) * (
                1.0 if name == "sinks" else param.shape[-1] ** -0.5))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, LENGTH, D_MODEL)).astype(np.float32)
    positions = np.stack([np.arange(LENGTH), np.arange(LENGTH) + 3]).astype(np.int32)
    hf_type = HF_TYPES[attention_type]
    x64, pos64 = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(positions.astype(np.int64))
    cos, sin = MiMoV2FlashRotaryEmbedding(config)(x64, pos64, hf_type)
    q_idx, kv_idx = torch.arange(LENGTH)[:, None], torch.arange(LENGTH)[None, :]
    visible = causal_mask_function(0, 0, q_idx, kv_idx)
    if attention_type == "S":
        visible = visible & sliding_window_overlay(WINDOW)(0, 0, q_idx, kv_idx)
    additive = torch.where(visible, 0.0, float("-inf")).to(torch.float64)[None, None]
    with torch.no_grad():
        expected, _ = theirs(x64, (cos.double(), sin.double()), additive)

    weights = {name: p.detach().numpy() for name, p in theirs.named_parameters()}
    kv_heads = {"F": 1, "S": 2}[attention_type]
    params = {
        "q_proj": {"kernel": weights["q_proj.weight"].T.reshape(D_MODEL, HEADS, QK_DIM)},
        "k_proj": {"kernel": weights["k_proj.weight"].T.reshape(D_MODEL, kv_heads, QK_DIM)},
        "v_proj": {"kernel": weights["v_proj.weight"].T.reshape(D_MODEL, kv_heads, V_DIM)},
        "o_proj": {"kernel": weights["o_proj.weight"].T.reshape(HEADS, V_DIM, D_MODEL)},
    }
    if attention_type == "S":
        params["sink"] = weights["sinks"]
    assert set(weights) == {f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj")} | (
        {"sinks"} if attention_type == "S" else set())
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    segments = np.zeros((2, LENGTH), np.int32)
    ours, _ = jax.jit(Attention(our_config(), attention_type).apply)(
        {"params": params}, x, positions, segments)
    # float32 against float64 with the rotary frequencies rounded to float32 in both.
    assert_close(ours, expected.numpy(), tol=5e-5)


@pytest.mark.parametrize("groups,kept,top_k", [(4, 2, 4), (8, 3, 4), (2, 1, 3)])
def test_group_limited_routing_matches_transformers(groups, kept, top_k):
    import torch
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashTopkRouter

    torch.manual_seed(groups)
    router = MiMoV2FlashTopkRouter(hf_config(n_group=groups, topk_group=kept,
                                             num_experts_per_tok=top_k,
                                             routed_scaling_factor=2.5)).double()
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, dtype=torch.float64))
        router.e_score_correction_bias.copy_(torch.randn(16, dtype=torch.float64) * 0.3)
    x = torch.randn(64, D_MODEL, dtype=torch.float64)
    logits, expected_weights, expected_indices = router(x)
    cfg = MoEConfig(num_experts=16, top_k=top_k, routed_scaling_factor=2.5, num_ep_groups=1,
                    num_groups=groups, topk_groups=kept)
    routing = route(jnp.asarray(logits.detach().numpy(), jnp.float32),
                    jnp.asarray(router.e_score_correction_bias.numpy(), jnp.float32), cfg)
    theirs = [dict(zip(i.tolist(), w.tolist())) for i, w in
              zip(expected_indices, expected_weights.detach())]
    ours = [dict(zip(i.tolist(), w.tolist())) for i, w in
            zip(np.asarray(routing.indices), np.asarray(routing.weights))]
    for n, (mine, reference) in enumerate(zip(ours, theirs)):
        assert set(mine) == set(reference), f"token {n}"
        np.testing.assert_allclose([mine[e] for e in reference], list(reference.values()),
                                   rtol=1e-5, err_msg=f"token {n}")
