"""The compressed-attention core (DeepSeek-V4 eqs. 19, 26, 27) against the float64 loop reference
of tests/compression_references.py (explicit visible-key lists: window, complete compressed
blocks of the query's document, the sink as an extra denominator term), the per-query
selection path, gradients, the absence of [T, T] arrays, and parity with a Hugging Face HCA
attention layer. Tolerance: float32 vs float64, 1e-5 absolute on unit-scale outputs.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from compression_references import reference_attention, reference_compress

import model.ops.compressed_attention as compressed_attention_module
from model.ops.compressed_attention import compressed_attention
from model.ops.interleaved_rope import rotate_trailing_pairs
from model.ops.kv_compression import CompressorParams, compress_kv

D_MODEL, DIM, HEADS = 12, 8, 3
INV_FREQ = 1.0 / 1000.0 ** (np.arange(2) / 2)


def make_case(seed, batch, length, rate, lengths_per_row):
    rng = np.random.default_rng(seed)
    params = CompressorParams(
        kv_proj=rng.normal(size=(D_MODEL, DIM)).astype(np.float32),
        gate_proj=rng.normal(size=(D_MODEL, DIM)).astype(np.float32),
        position_bias=rng.normal(size=(rate, DIM)).astype(np.float32),
        kv_norm=(1 + 0.3 * rng.normal(size=DIM)).astype(np.float32))
    hidden = rng.normal(size=(batch, length, D_MODEL)).astype(np.float32)
    segments = np.stack([np.concatenate([np.full(n, i + 1) for i, n in enumerate(row)])
                         for row in lengths_per_row]).astype(np.int32)
    q = rng.normal(size=(batch, length, HEADS, DIM)).astype(np.float32)
    kv = rng.normal(size=(batch, length, DIM)).astype(np.float32)
    sink = rng.normal(size=HEADS).astype(np.float32)
    return params, hidden, segments, q, kv, sink


def run(params, hidden, segments, q, kv, sink, rate, window, **kw):
    comp = compress_kv(jnp.asarray(hidden), params, rate=rate, overlap=False,
                       inv_freq=jnp.asarray(INV_FREQ), segment_ids=jnp.asarray(segments))
    out = compressed_attention(jnp.asarray(q), jnp.asarray(kv), comp, jnp.asarray(sink),
                               window=window, segment_ids=jnp.asarray(segments), **kw)
    entries = reference_compress(hidden, *params, rate, False, INV_FREQ, segments)
    return out, entries


@pytest.mark.parametrize("chunk", [4, 16], ids=["chunked", "one_chunk"])
def test_hca_attention_matches_loop_reference(chunk):
    """Packed rows, tails, T not a multiple of the chunk, sink; window 3 < block 4."""
    case = make_case(0, 2, 15, 4, [[6, 9], [15]])
    out, entries = run(*case, rate=4, window=3, query_chunk=chunk)
    params, hidden, segments, q, kv, sink = case
    want = reference_attention(q, kv, entries, sink, 3, segments)
    np.testing.assert_allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("chunk, rows", [(4, 16), (16, 4)], ids=["chunks", "row_blocks"])
def test_selected_entries_match_loop_reference(chunk, rows, monkeypatch):
    """Per-query picks with -1 (none), and picks of not-yet-visible or other-document entries
    (ignored); a chunk's queries in one block, or in blocks of `rows`."""
    monkeypatch.setattr(compressed_attention_module, "SELECTED_ROWS", {"cpu": rows})
    case = make_case(1, 2, 16, 2, [[7, 9], [16]])
    rng = np.random.default_rng(2)
    selected = np.stack([np.stack([rng.permutation(8)[:3] for _ in range(16)]) for _ in range(2)])
    selected[:, ::3, 1] = -1
    out, entries = run(*case, rate=2, window=2, selected=jnp.asarray(selected),
                       query_chunk=chunk)
    params, hidden, segments, q, kv, sink = case
    want = reference_attention(q, kv, entries, sink, 2, segments, selected)
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_selecting_every_entry_equals_dense_visibility():
    case = make_case(3, 1, 12, 3, [[12]])
    every = jnp.broadcast_to(jnp.arange(4), (1, 12, 4))
    dense, _ = run(*case, rate=3, window=4)
    sparse, _ = run(*case, rate=3, window=4, selected=every)
    np.testing.assert_allclose(dense, sparse, atol=1e-6)


@pytest.mark.parametrize("selected", [False, True], ids=["hca", "csa"])
def test_gradients_reach_every_input(selected):
    params, hidden, segments, q, kv, sink = make_case(4, 1, 12, 3, [[12]])
    comp = compress_kv(jnp.asarray(hidden), params, rate=3, overlap=False,
                       inv_freq=jnp.asarray(INV_FREQ))
    picks = jnp.broadcast_to(jnp.asarray([3, 0, -1]), (1, 12, 3)) if selected else None
    probe = jnp.asarray(np.random.default_rng(5).normal(size=q.shape), jnp.float32)

    def loss(q, kv, entries, sink):
        out = compressed_attention(q, kv, comp._replace(entries=entries), sink, window=2,
                                   selected=picks, query_chunk=4)
        return jnp.sum(out * probe)

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(jnp.asarray(q), jnp.asarray(kv), comp.entries,
                                                  jnp.asarray(sink))
    for name, g in zip(("q", "kv", "entries", "sink"), grads):
        assert np.all(np.isfinite(g)) and np.any(g != 0), name


def _shapes(jaxpr):
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(getattr(var.aval, "shape", ()))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _shapes(sub)


@pytest.mark.parametrize("selected", [False, True], ids=["hca", "csa"])
def test_no_t_by_t_array_in_forward_or_backward(selected):
    length, rate, window = 256, 16, 16
    params, hidden, segments, q, kv, sink = make_case(6, 1, length, rate, [[100, 156]])
    picks = jnp.zeros((1, length, 4), jnp.int32) if selected else None

    def loss(hidden, q, kv, sink):
        comp = compress_kv(hidden, params, rate=rate, overlap=False,
                           inv_freq=jnp.asarray(INV_FREQ), segment_ids=jnp.asarray(segments))
        return jnp.sum(compressed_attention(q, kv, comp, sink, window=window, selected=picks,
                                            segment_ids=jnp.asarray(segments), query_chunk=32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(
        jnp.asarray(hidden), jnp.asarray(q), jnp.asarray(kv), jnp.asarray(sink))
    shapes = list(_shapes(jaxpr.jaxpr))
    assert any(len(s) >= 4 for s in shapes)  # the walk reached the attention scores
    for shape in shapes:
        assert sum(d >= length for d in shape) <= 1, shape


def rms(x, weight=None, eps=1e-6):
    y = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps)
    return y if weight is None else y * weight


@pytest.mark.slow
@pytest.mark.parity
def test_hca_attention_layer_matches_transformers():
    """A whole Hugging Face HCA attention layer (q low-rank path, shared-KV MQA, compressor,
    sink, inverse RoPE on the output, grouped output projection) rebuilt around our core."""
    import torch
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4Attention,
        DeepseekV4RotaryEmbedding,
    )

    rate, window, length, groups = 4, 5, 19, 3
    config = DeepseekV4Config(
        vocab_size=32, hidden_size=D_MODEL, num_hidden_layers=1, num_attention_heads=HEADS,
        head_dim=DIM, q_lora_rank=6, partial_rotary_factor=0.5, compress_rope_theta=1000.0,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": rate},
        sliding_window=window, o_groups=groups, o_lora_rank=5, rms_norm_eps=1e-6,
        layer_types=["heavily_compressed_attention"])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = DeepseekV4Attention(config, 0).float().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    w = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
    hidden = np.random.default_rng(7).normal(size=(2, length, D_MODEL)).astype(np.float32)
    positions = torch.arange(length)[None].expand(2, -1)
    i = torch.arange(length)
    mask = torch.where((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window), 0.0,
                       float("-inf"))[None, None].expand(2, 1, -1, -1)
    rotary = DeepseekV4RotaryEmbedding(config)
    x = torch.from_numpy(hidden)
    embeddings = {name: rotary(x, positions, name) for name in ("compress", "main")}
    with torch.no_grad():
        want = layer(x, embeddings, positions, mask)[0].numpy()

    h = jnp.asarray(hidden)
    pos = jnp.broadcast_to(jnp.arange(length), (2, length))
    inv_freq = jnp.asarray(INV_FREQ, jnp.float32)
    q = rms(h @ w["q_a_proj.weight"].T, w["q_a_norm.weight"]) @ w["q_b_proj.weight"].T
    q = rotate_trailing_pairs(rms(q.reshape(2, length, HEADS, DIM)), pos, inv_freq)
    kv = rotate_trailing_pairs(rms(h @ w["kv_proj.weight"].T, w["kv_norm.weight"]), pos, inv_freq)
    params = CompressorParams(*(jnp.asarray(w[f"compressor.{n}"]) for n in (
        "kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight")))
    params = params._replace(kv_proj=params.kv_proj.T, gate_proj=params.gate_proj.T)
    comp = compress_kv(h, params, rate=rate, overlap=False, inv_freq=inv_freq)
    out = compressed_attention(q, kv, comp, jnp.asarray(w["sinks"]), window=window,
                               query_chunk=8)
    out = rotate_trailing_pairs(out, -pos, inv_freq)  # undo the values' RoPE at the query
    grouped = out.reshape(2, length, groups, -1)
    o_a = w["o_a_proj.weight"].reshape(groups, -1, grouped.shape[-1])
    got = jnp.einsum("btgi,goi->btgo", grouped, o_a).reshape(2, length, -1) @ w["o_b_proj.weight"].T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
