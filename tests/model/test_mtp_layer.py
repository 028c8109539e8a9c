"""DeepSeek-V4's MTP block (`mtp.block: layer`, model/layers/mtp.py) against the release's
`MTPBlock` written out in float64 numpy for everything the head adds around its decoder layer:

    e = enorm(Emb(x_{t+h}));  H' = e_proj(e) + h_proj(hnorm(H_prev))   (e into every stream)
    H_out = the decoder layer (H');  logits = head(norm(hc_head(H_out)))

H_prev is the backbone's mHC streams before its hc_head (head 1) or the previous head's H_out
(head 2); the decoder layer itself is the model's own (tested against transformers elsewhere),
applied here on the reference's H'. The transformers release has no MTP (it drops `mtp.*`), so
this is the reference for the block's wiring; its weights' import and export are in
test_hf_deepseek_v4.py.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import SMALL_V4, TINY_V4

from model.config import load_config
from model.layers.block import DecoderBlock
from model.lm import CausalLM, init_variables

CFG = load_config(TINY_V4, [o.removeprefix("model.") for o in SMALL_V4 if o.startswith("model.")]
                  + ["mtp.num_heads=2", "vocab_size=64", "init_std=0.2"])
VARIABLES = nn.meta.unbox(init_variables(CausalLM(CFG), jax.random.key(3)))
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)


def rms_norm(x, offset, eps=CFG.norm_eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1 + offset)


def hc_head(streams, fn, base, scale):
    """The head collapse (report 2.2; the release's hc_head): streams [B, T, n, D]."""
    flat = streams.reshape(*streams.shape[:2], -1)
    normed = flat / np.sqrt(np.mean(flat * flat, -1, keepdims=True) + CFG.norm_eps)
    pre = 1 / (1 + np.exp(-(normed @ fn.reshape(-1, fn.shape[-1]) * scale + base)))
    return np.einsum("btn,btnd->btd", pre + CFG.hyper_connections.eps, streams)


def f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


@jax.jit
def model_outputs(variables):
    out = CausalLM(CFG).apply(variables, TOKENS)
    _, streams, _ = CausalLM(CFG).apply(variables, TOKENS, jnp.broadcast_to(
        jnp.arange(12), (2, 12)), None, method=CausalLM.backbone)
    return out.mtp_logits, streams


@jax.jit
def decoder_layer(block_variables, streams):
    """The MTP's decoder layer (its params) on given input streams."""
    layer = DecoderBlock(CFG, "W", is_moe=True, limit=CFG.swiglu_limits[-1],
                         shared_limit=CFG.swiglu_limits_shared[-1], streams=True)
    return layer.apply(block_variables, streams, jnp.broadcast_to(jnp.arange(12), (2, 12)),
                       None)[0]


@pytest.mark.slow
def test_the_layer_block_is_the_release_mtp_block_chained_over_two_heads():
    params, balance = VARIABLES["params"], VARIABLES["balance"]
    mtp_logits, streams = model_outputs(VARIABLES)
    assert streams.shape == (2, 12, CFG.hyper_connections.hc_mult, CFG.d_model)
    embedding, head = f64(params["embed_tokens"]["embedding"]), f64(params["lm_head"]["kernel"])
    h_prev = np.asarray(streams, np.float64)
    for h in range(2):
        p = f64(params[f"mtp_{h}"])
        assert "output_head" not in p  # the release shares the model's head
        shifted = np.pad(np.asarray(TOKENS)[:, h + 1:], ((0, 0), (0, h + 1)))
        e = rms_norm(embedding[shifted], p["enorm"]["weight"]) @ p["e_proj"]["kernel"]
        hidden = rms_norm(h_prev, p["hnorm"]["weight"]) @ p["h_proj"]["kernel"]
        layer_in = hidden + e[:, :, None, :]
        block = {"params": params[f"mtp_{h}"]["block"], "balance": balance[f"mtp_{h}"]["block"]}
        h_prev = np.asarray(decoder_layer(block, jnp.asarray(layer_in, jnp.float32)), np.float64)
        collapsed = hc_head(h_prev, p["hc_head"]["hc_fn"], p["hc_head"]["hc_base"],
                            p["hc_head"]["hc_scale"])
        want = rms_norm(collapsed, p["norm"]["weight"]) @ head
        np.testing.assert_allclose(mtp_logits[h], want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
