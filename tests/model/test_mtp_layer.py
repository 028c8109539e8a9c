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
def model_outputs(variables, tokens, segments):
    """(MTP logits, the backbone's streams, the balance losses) of one forward."""
    out = CausalLM(CFG).apply(variables, tokens, segments)
    _, streams, _ = CausalLM(CFG).apply(variables, tokens, jnp.broadcast_to(
        jnp.arange(12), (2, 12)), None, method=CausalLM.backbone)
    losses = ("moe", "mtp_moe", "sequence_balance_loss", "balance_loss")
    return out.mtp_logits, streams, {k: out.aux[k] for k in losses}


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
    mtp_logits, streams, _ = model_outputs(VARIABLES, TOKENS, jnp.ones_like(TOKENS))
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


def test_mtp_moe_adds_its_balance_losses_and_padding_stays_out_of_them():
    """The MTP blocks' MoE layers add their sequence-wise (and EP-group) balance losses to those
    of the backbone's learned-routing layers, as a backbone MoE layer does. Padding (segment 0)
    is no part of a sequence: the backbone layers' sequence-wise losses ignore what the padding
    tokens are (real tokens never attend to them; the MTP blocks do read the next tokens'
    embeddings, padding's included, at a document's end)."""
    def aux_of(tokens, segments):
        return model_outputs(VARIABLES, tokens, segments)[2]

    segments = jnp.asarray([[1] * 12, [1] * 8 + [0] * 4], jnp.int32)
    aux = aux_of(TOKENS, segments)
    learned = np.asarray([not CFG.is_hash_layer(i) for i in CFG.moe_layer_indices()])
    assert not learned.all() and learned.any()  # a hash-routed layer is left out
    for key in ("sequence_balance_loss", "balance_loss"):
        backbone = np.sum(np.asarray(aux["moe"][key])[learned])
        np.testing.assert_allclose(aux[key], backbone + np.sum(aux["mtp_moe"][key]), rtol=1e-5)
    assert np.all(np.asarray(aux["mtp_moe"]["sequence_balance_loss"]) > 0.5)
    repadded = aux_of(TOKENS.at[1, 8:].set(jnp.asarray([5, 17, 33, 60])), segments)
    np.testing.assert_allclose(repadded["moe"]["sequence_balance_loss"],
                               aux["moe"]["sequence_balance_loss"], rtol=1e-6)
