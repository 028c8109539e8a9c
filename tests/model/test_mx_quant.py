"""The low-precision formats of DeepSeek-V4 (model/ops/mx_quant.py) against independent
references: float64 numpy with the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} written out (nearest
value, ties to the even code as an IEEE cast rounds), scales from float64 log2, and E4M3 decoded
by ml_dtypes; plus the FP4 -> FP8 transfer's exactness bound and the straight-through gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from model.ops import mx_quant, sparse_indexer

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
# jitted once per shape: op by op, the many small ops dispatch slowly
quantize = jax.jit(mx_quant.mxfp4_quantize)
dequantize = jax.jit(mx_quant.mx_dequantize, static_argnums=2)


@jax.jit
def fp4_fp8_round_trip(w):
    values, exponent = mx_quant.mxfp4_quantize(w)
    fp8, tile_exponent = mx_quant.fp4_to_fp8(values, exponent)
    return (mx_quant.mx_dequantize(values, exponent, 32), fp8, tile_exponent,
            mx_quant.fp8_tiles_dequantize(fp8, tile_exponent))


def e2m1_nearest(x: np.ndarray) -> np.ndarray:
    """x (float64, |x| <= 6) on the E2M1 grid: nearest, ties to the even code."""
    distance = np.abs(np.abs(x)[..., None] - E2M1)
    tied = distance == distance.min(-1, keepdims=True)
    # among the nearest codes, the even one (E2M1 code k = index k: even = mantissa bit 0)
    code = np.argmin(np.where(tied, np.arange(8) % 2, 2), axis=-1)
    return np.sign(x) * E2M1[code]


def mxfp4_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values [..., n], exponents [..., ceil(n / 32)]) of rows x [..., n], block by block (a
    last partial block zero-padded, as the OCP MX spec pads)."""
    n = x.shape[-1]
    padded = np.pad(x.astype(np.float32), [(0, 0)] * (x.ndim - 1) + [(0, -n % 32)])
    blocks = padded.reshape(*x.shape[:-1], -1, 32)
    amax = np.max(np.abs(blocks), -1)
    ratio = np.maximum(amax, np.float32(6 * 2.0 ** -126)) / np.float32(6)  # float32, as the code
    exponent = np.ceil(np.log2(ratio.astype(np.float64))).astype(np.int32)
    values = e2m1_nearest(blocks / 2.0 ** exponent[..., None])
    return values.reshape(padded.shape)[..., :n], exponent


def mxfp4_values(x: np.ndarray) -> np.ndarray:
    """The float64 values `mxfp4_reference` stands for."""
    values, exponent = mxfp4_reference(x)
    return values * 2.0 ** np.repeat(exponent, 32, -1)[..., :x.shape[-1]]


def test_mxfp4_matches_the_float64_reference_ties_and_extremes_included():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 64)) * np.exp(rng.uniform(-8, 8, (3, 4, 1)))
    # a block whose amax is 6·2^k exactly and that holds every tie of the grid at that scale
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 2.0 ** -3
    x[0, 0, :32] = np.resize(np.concatenate([ties, -ties]), 32)
    x[0, 1, :32] = 0.0  # an all-zero block: the floor exponent, values 0
    values, exponent = quantize(jnp.asarray(x, jnp.float32))
    want_values, want_exponent = mxfp4_reference(x)
    np.testing.assert_array_equal(np.asarray(exponent), want_exponent)
    np.testing.assert_array_equal(np.asarray(values, np.float64), want_values)
    assert exponent[0, 0, 0] == -3 and exponent[0, 1, 0] == -126
    np.testing.assert_array_equal(np.asarray(values[0, 0, :8], np.float64),
                                  [0, 1, 1, 2, 2, 4, 4, 6])  # ties to even, 5 -> 4
    got = dequantize(values, exponent, 32)
    np.testing.assert_array_equal(np.asarray(got), (want_values * 2.0 ** np.repeat(
        want_exponent, 32, -1)).astype(np.float32))


def test_a_partial_last_block_is_quantized_as_if_zero_padded():
    x = np.random.default_rng(1).standard_normal((2, 40)).astype(np.float32)
    values, exponent = quantize(jnp.asarray(x))
    want_values, want_exponent = mxfp4_reference(x)
    assert want_exponent.shape == (2, 2)
    np.testing.assert_array_equal(np.asarray(exponent), want_exponent)
    np.testing.assert_array_equal(np.asarray(values, np.float64), want_values)


def tile(span: int) -> np.ndarray:
    """One 128 x 128 weight tile of MXFP4 values: sub-block (0, 0) at exponent 3 holds 6·2^3,
    sub-block (1, 0) at exponent 3 - span holds the smallest grid values 0.5 and 1.5 there."""
    w = np.zeros((128, 128), np.float32)
    w[0, :32] = 6 * 2.0 ** 3
    w[1, :2] = np.array([6, 0.5]) * 2.0 ** (3 - span)
    w[1, 2] = 1.5 * 2.0 ** (3 - span)
    return w


@pytest.mark.parametrize("span, exact", [(0, True), (14, True), (15, False)])
def test_fp4_to_fp8_is_exact_within_the_exponent_span(span, exact):
    """The tile exponent is the largest sub-block exponent minus 6: E4M3 then holds every E2M1
    value of a sub-block whose exponent is at most 14 below, and loses 0.5·2^k at 15 below."""
    fp4, fp8, tile_exponent, back = fp4_fp8_round_trip(jnp.asarray(tile(span)))
    np.testing.assert_array_equal(fp4, tile(span))  # the test's values are on the FP4 grid
    assert fp8.dtype == jnp.float8_e4m3fn and tile_exponent.shape == (1, 1)
    assert int(tile_exponent[0, 0]) == 3 - 6
    decoded = np.asarray(fp8).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** -3
    assert np.array_equal(decoded, np.asarray(fp4, np.float64)) == exact
    np.testing.assert_array_equal(back, decoded.astype(np.float32))


def test_fp8_tiles_cover_partial_tiles_per_expert():
    """[E, 200, 150] weights: 2 x 2 tiles per expert, the last ones partial; random weights
    (one scale of magnitude) transfer exactly."""
    fp4, _, tile_exponent, back = fp4_fp8_round_trip(
        jax.random.normal(jax.random.key(0), (2, 200, 150)))
    assert tile_exponent.shape == (2, 2, 2)
    np.testing.assert_array_equal(back, fp4)


def test_fp8_blocks_match_the_reference():
    """E4M3 per 64 values with 2^ceil(log2(amax / 448)) scales (amax floored at 1e-4)."""
    x = np.random.default_rng(2).standard_normal((3, 100)) * np.array([[1e-6], [1.0], [300.0]])
    values, exponent = jax.jit(mx_quant.fp8_blocks, static_argnums=1)(jnp.asarray(x, jnp.float32),
                                                                       64)
    padded = np.pad(x.astype(np.float32), ((0, 0), (0, 28))).reshape(3, 2, 64)
    amax = np.maximum(np.abs(padded).max(-1), np.float32(1e-4)) / np.float32(448)
    want_exponent = np.ceil(np.log2(amax.astype(np.float64))).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(exponent), want_exponent)
    want = (padded / 2.0 ** want_exponent[..., None]).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(values).view(np.uint8),
                                  want.reshape(3, 128)[:, :100].view(np.uint8))


def test_fake_quantization_passes_the_gradient_straight_through():
    w = jax.random.normal(jax.random.key(1), (2, 64, 32))
    scale = jax.random.normal(jax.random.key(2), w.shape)
    for fake in (mx_quant.fake_mxfp4_weight, mx_quant.fake_mxfp4):
        grad = jax.jit(jax.grad(lambda w, f=fake: jnp.sum(scale * f(w))))(w)
        np.testing.assert_array_equal(grad, scale)
    # the forward values: the weight's MXFP4 along its input axis (rows of the torch layout)
    want = mxfp4_values(np.asarray(w).transpose(0, 2, 1)).transpose(0, 2, 1)
    np.testing.assert_array_equal(np.asarray(jax.jit(mx_quant.fake_mxfp4_weight)(w)), want)


def test_hadamard_is_orthonormal_with_equal_magnitudes():
    h = mx_quant.hadamard(16)
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    np.testing.assert_allclose(np.abs(h), 0.25)
    with pytest.raises(ValueError, match="power-of-two"):
        mx_quant.hadamard(12)


def test_the_indexer_qk_path_rotates_and_quantizes_and_rounds_scores_to_bfloat16():
    """Inputs on a dyadic grid with c = 64 (Hadamard entries ±1/8): every product and sum is
    exact in float32, so the references are exact too (scipy's Hadamard matrix)."""
    from scipy.linalg import hadamard

    rng = np.random.default_rng(3)
    q = rng.integers(-8, 9, (1, 3, 2, 64)) / 4  # [B, T, H, c]
    k = rng.integers(-8, 9, (1, 5, 64)) / 4  # [B, S, c]
    rotation = hadamard(64) / 8
    got = jax.jit(sparse_indexer.fp4_qk)(jnp.asarray(q, jnp.float32))
    np.testing.assert_array_equal(got, mxfp4_values(q @ rotation))

    weights = rng.integers(-3, 4, (1, 3, 2)).astype(np.float64)
    scores = jax.jit(sparse_indexer.index_scores, static_argnums=3)(
        *(jnp.asarray(a, jnp.float32) for a in (q, weights, k)), jnp.bfloat16)
    want = np.einsum("bths,bth->bts", np.maximum(np.einsum("bthc,bsc->bths", q, k), 0) / 8,
                     weights)
    assert not np.array_equal(want.astype(ml_dtypes.bfloat16).astype(np.float64), want)
    np.testing.assert_array_equal(scores, want.astype(ml_dtypes.bfloat16).astype(np.float32))
