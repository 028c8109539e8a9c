"""KV compression (DeepSeek-V4 eqs. 9-12 CSA, 20-23 HCA) against the float64 loop references of
tests/compression_references.py, document boundaries in packed rows, gradients, and parity
with Hugging Face's `DeepseekV4HCACompressor` / `DeepseekV4CSACompressor`.

Tolerance: float32 vs float64 after a softmax pooling, an RMSNorm and RoPE: 1e-5 absolute on
entries of unit RMS.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compression_references import reference_compress

from model.ops.kv_compression import CompressorParams, block_starts, compress_kv, document_offsets

D_MODEL, WIDTH, ROPE_HALF = 12, 8, 2
INV_FREQ = 1.0 / 1000.0 ** (np.arange(ROPE_HALF) / ROPE_HALF)


def random_params(rate, overlap, seed=0):
    rng = np.random.default_rng(seed)
    feat = 2 * WIDTH if overlap else WIDTH
    return CompressorParams(
        kv_proj=rng.normal(size=(D_MODEL, feat)).astype(np.float32),
        gate_proj=rng.normal(size=(D_MODEL, feat)).astype(np.float32),
        position_bias=rng.normal(size=(rate, feat)).astype(np.float32),
        kv_norm=(1 + 0.3 * rng.normal(size=WIDTH)).astype(np.float32))


def segments_of(lengths):
    return np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(lengths)])


def check_against_reference(hidden, params, rate, overlap, segments):
    got = compress_kv(jnp.asarray(hidden), params, rate=rate, overlap=overlap,
                      inv_freq=jnp.asarray(INV_FREQ), segment_ids=jnp.asarray(segments))
    want = reference_compress(hidden, *params, rate, overlap, INV_FREQ, segments)
    length = hidden.shape[1]
    assert got.entries.shape == (hidden.shape[0], length // rate, WIDTH)
    for b, entries in enumerate(want):
        n = len(entries)
        assert n > 0
        np.testing.assert_allclose(got.entries[b, :n], np.stack([e[0] for e in entries]),
                                   atol=1e-5)
        np.testing.assert_array_equal(got.last_token[b, :n], [e[1] for e in entries])
        np.testing.assert_array_equal(got.segment_ids[b, :n], [e[2] for e in entries])
        np.testing.assert_array_equal(got.entries[b, n:], 0)  # empty slots
        np.testing.assert_array_equal(got.last_token[b, n:], length)
    return got


@pytest.mark.parametrize("overlap", [False, True], ids=["hca", "csa"])
def test_single_document_matches_loop_reference(overlap):
    rate = 4
    hidden = np.random.default_rng(1).normal(size=(2, 18, D_MODEL)).astype(np.float32)
    segments = np.ones((2, 18), np.int32)  # 4 blocks + a 2-token tail that makes no entry
    got = check_against_reference(hidden, random_params(rate, overlap), rate, overlap, segments)
    np.testing.assert_array_equal(got.last_token[0], [3, 7, 11, 15])


@pytest.mark.parametrize("overlap", [False, True], ids=["hca", "csa"])
def test_packed_documents_match_loop_reference(overlap):
    """Blocks restart at each document (each first block is a CSA boundary block), tails drop."""
    rate = 3
    rows = [segments_of([7, 9, 2, 6]), segments_of([3, 1, 13, 7])]
    hidden = np.random.default_rng(2).normal(size=(2, 24, D_MODEL)).astype(np.float32)
    check_against_reference(hidden, random_params(rate, overlap, 3), rate, overlap,
                            np.stack(rows))


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["hca", "csa"])
def test_packed_document_compresses_as_if_alone(overlap):
    rate, lengths = 4, [9, 12, 3]
    params = random_params(rate, overlap, 4)
    hidden = np.random.default_rng(5).normal(size=(1, sum(lengths), D_MODEL)).astype(np.float32)
    packed = compress_kv(jnp.asarray(hidden), params, rate=rate, overlap=overlap,
                         inv_freq=jnp.asarray(INV_FREQ),
                         segment_ids=jnp.asarray(segments_of(lengths))[None])
    slot, start = 0, 0
    for n in lengths:
        alone = compress_kv(jnp.asarray(hidden[:, start:start + n]), params, rate=rate,
                            overlap=overlap, inv_freq=jnp.asarray(INV_FREQ))
        k = n // rate
        np.testing.assert_allclose(packed.entries[0, slot:slot + k], alone.entries[0, :k],
                                   atol=1e-6)
        np.testing.assert_array_equal(packed.last_token[0, slot:slot + k],
                                      alone.last_token[0, :k] + start)
        slot, start = slot + k, start + n
    assert slot == 5
    np.testing.assert_array_equal(packed.entries[0, slot:], 0)


def test_boundary_block_ignores_the_previous_document():
    """CSA: changing the tokens of document 1 leaves document 2's first entry unchanged."""
    rate, params = 2, random_params(2, True, 6)
    segments = jnp.asarray(segments_of([4, 4]))[None]
    hidden = np.random.default_rng(7).normal(size=(1, 8, D_MODEL)).astype(np.float32)
    other = hidden.copy()
    other[:, :4] = np.random.default_rng(8).normal(size=(1, 4, D_MODEL))

    def run(h):
        return compress_kv(jnp.asarray(h), params, rate=rate, overlap=True,
                           inv_freq=jnp.asarray(INV_FREQ), segment_ids=segments).entries

    a, b = run(hidden), run(other)
    np.testing.assert_array_equal(a[0, 2:], b[0, 2:])
    assert not np.allclose(a[0, :2], b[0, :2])


def test_block_starts_and_offsets():
    segments = jnp.asarray([[1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3],
                            [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 0]])
    np.testing.assert_array_equal(document_offsets(segments)[0],
                                  [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3])
    np.testing.assert_array_equal(block_starts(segments, 2), [[0, 2, 5, 8, 10, 12],
                                                              [0, 2, 4, 6, 8, 12]])
    np.testing.assert_array_equal(block_starts(segments, 4), [[0, 8, 12], [0, 4, 12]])


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["hca", "csa"])
def test_gradients_reach_every_compressor_parameter(overlap):
    rate = 4
    params = jax.tree.map(jnp.asarray, random_params(rate, overlap, 9))
    hidden = jnp.asarray(np.random.default_rng(10).normal(size=(2, 16, D_MODEL)), jnp.float32)
    segments = jnp.asarray(np.stack([segments_of([16]), segments_of([10, 6])]))
    probe = jnp.asarray(np.random.default_rng(11).normal(size=(2, 4, WIDTH)), jnp.float32)

    def loss(p, h):
        out = compress_kv(h, p, rate=rate, overlap=overlap, inv_freq=jnp.asarray(INV_FREQ),
                          segment_ids=segments)
        return jnp.sum(out.entries * probe)

    grads = jax.grad(loss, argnums=(0, 1))(params, hidden)
    for name, g in zip(CompressorParams._fields + ("hidden",), (*grads[0], grads[1])):
        assert np.all(np.isfinite(g)), name
        assert np.any(g != 0), name
    if overlap:  # both halves of every CSA matrix learn (previous-block and current series)
        for g in (grads[0].kv_proj, grads[0].gate_proj, grads[0].position_bias):
            assert np.any(g[:, :WIDTH] != 0) and np.any(g[:, WIDTH:] != 0)


def tiny_hf_config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=32, hidden_size=D_MODEL, num_hidden_layers=2, num_attention_heads=2,
        head_dim=WIDTH, q_lora_rank=6, partial_rotary_factor=2 * ROPE_HALF / WIDTH,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        compress_rope_theta=1000.0, sliding_window=4, o_groups=2, o_lora_rank=4,
        index_n_heads=2, index_head_dim=WIDTH, index_topk=2, rms_norm_eps=1e-6,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"])


def torch_compressor_parity(cls, overlap, rate):
    import torch

    torch.manual_seed(0)
    module = cls(tiny_hf_config()).float()
    params = random_params(rate, overlap, 12)
    with torch.no_grad():
        module.kv_proj.weight.copy_(torch.from_numpy(params.kv_proj.T.copy()))
        module.gate_proj.weight.copy_(torch.from_numpy(params.gate_proj.T.copy()))
        module.position_bias.copy_(torch.from_numpy(params.position_bias))
        module.kv_norm.weight.copy_(torch.from_numpy(params.kv_norm))
        for p in getattr(module, "indexer", torch.nn.Module()).parameters():
            p.normal_()
    length = 3 * rate + 2
    hidden = np.random.default_rng(13).normal(size=(2, length, D_MODEL)).astype(np.float32)
    positions = torch.arange(length)[None].expand(2, -1)
    with torch.no_grad():
        want, _ = module(torch.from_numpy(hidden), torch.randn(2, length, 6), positions, None, 0)
    got = compress_kv(jnp.asarray(hidden), params, rate=rate, overlap=overlap,
                      inv_freq=jnp.asarray(INV_FREQ, jnp.float32))
    np.testing.assert_allclose(got.entries, want[:, 0].numpy(), rtol=1e-4, atol=1e-5)
    return module, got


@pytest.mark.parity
def test_hca_compressor_matches_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HCACompressor

    torch_compressor_parity(DeepseekV4HCACompressor, False, 8)


@pytest.mark.parity
def test_csa_compressor_matches_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACompressor

    torch_compressor_parity(DeepseekV4CSACompressor, True, 4)
