"""Low-precision formats of DeepSeek-V4 (report §3.4, §5.2.1; §2.3.4 for the KV cache), as
quantize / dequantize pairs on JAX arrays, and their straight-through fake quantization.

- MXFP4 (OCP MX): E2M1 values {0, 0.5, 1, 1.5, 2, 3, 4, 6} (and their negatives) times one
  power-of-two scale per 32 consecutive values of the last axis (a row of a torch [out, in]
  weight: the release's layout). The scale is the release kernel's: 2^ceil(log2(amax / 6)),
  amax floored at 6·2^-126, so the block's largest value never clips; values round to nearest,
  ties to even (an E2M1 cast). Exponents are returned as integers k (scale 2^k; the E8M0 byte
  is k + 127).
- FP8 tiles (`fp4_to_fp8`): the FP4 values re-expressed as E4M3 with one power-of-two scale per
  128 x 128 tile, for a framework that computes in FP8. With the tile exponent set to its
  largest sub-block exponent minus 6 (6·2^6 = 384 <= 448) every E2M1 value of a sub-block whose
  exponent is at most 14 below that largest one lands on an E4M3 normal or subnormal exactly:
  the report's "lossless if the max / min scale ratio within a tile stays under a threshold",
  with the threshold 2^14 for this choice (sub-blocks of zeros hold nothing to lose).
- FP8 blocks (`fp8_blocks`): E4M3 with one power-of-two scale per `block` values of the last
  axis (2^ceil(log2(amax / 448)), amax floored at 1e-4, as the release's `act_quant` with
  `scale_fmt: ue8m0`): the KV cache's non-RoPE channels (block 64).
A last block shorter than its size is quantized as if zero-padded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

E2M1_MAX, E4M3_MAX = 6.0, 448.0
MX_BLOCK = 32  # values per MXFP4 scale
FP8_TILE = 128  # rows and columns per FP8 scale of `fp4_to_fp8`
FP8_HEADROOM = 6  # 6 * 2^6 = 384 <= 448 < 6 * 2^7


def _blocked(x: jax.Array, block: int) -> jax.Array:
    """[..., n] -> [..., ceil(n / block), block], zero-padded."""
    n = x.shape[-1]
    pad = -n % block
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], (n + pad) // block, block)


def _unblocked(x: jax.Array, n: int) -> jax.Array:
    """[..., m, block] -> [..., n] (n <= m * block; explicit sizes: rows may be empty)."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])[..., :n]


def pow2_exponent(ratio: jax.Array) -> jax.Array:
    """ceil(log2(ratio)) of positive float32 `ratio`, exactly (no log): int32."""
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    return jnp.where(mantissa == 0.5, exponent - 1, exponent).astype(jnp.int32)


def pow2(exponent: jax.Array) -> jax.Array:
    """2^exponent as float32, built from its bits (exact), exponents clipped to the normal
    range [-126, 127]."""
    biased = jnp.clip(exponent, -126, 127).astype(jnp.int32) + 127
    return jax.lax.bitcast_convert_type(biased << 23, jnp.float32)


def _scaled(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """x / 2^exponent (exact unless it under- or overflows)."""
    return x * pow2(-exponent)


def mxfp4_quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., n] -> (E2M1 values [..., n] as float4_e2m1fn, exponents [..., ceil(n / 32)]
    int32): x ~ values * 2^exponent of their block."""
    x = x.astype(jnp.float32)
    blocks = _blocked(x, MX_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    exponent = pow2_exponent(jnp.maximum(amax, E2M1_MAX * 2.0 ** -126) / E2M1_MAX)
    values = jnp.clip(_scaled(blocks, exponent[..., None]), -E2M1_MAX, E2M1_MAX)
    return _unblocked(values.astype(jnp.float4_e2m1fn), x.shape[-1]), exponent


def mx_dequantize(values: jax.Array, exponent: jax.Array, block: int) -> jax.Array:
    """values [..., n] times 2^exponent [..., ceil(n / block)] of their block: float32."""
    blocks = _blocked(values.astype(jnp.float32), block)
    return _unblocked(blocks * pow2(exponent[..., None]), values.shape[-1])


def fp4_to_fp8(values: jax.Array, exponent: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MXFP4 weights (values [..., rows, n], exponents [..., rows, ceil(n / 32)]) -> (E4M3
    values [..., rows, n], tile exponents [..., ceil(rows / 128), ceil(n / 128)]): one scale per
    128 x 128 tile, exact while a tile's sub-block exponents span at most 14."""
    per_tile = FP8_TILE // MX_BLOCK
    # sub-blocks of zeros carry the floor exponent: they never set the tile's maximum unless
    # the whole tile is zero (the tile exponent stays a normal float32 power of two)
    tiles = _blocked(jnp.swapaxes(_blocked(exponent, per_tile).max(-1), -1, -2), FP8_TILE)
    tile_exponent = jnp.maximum(jnp.swapaxes(tiles.max(-1), -1, -2) - FP8_HEADROOM, -126)
    fp4 = mx_dequantize(values, exponent, MX_BLOCK)
    fp8 = jnp.clip(_scaled(fp4, _per_value(tile_exponent, values.shape)), -E4M3_MAX, E4M3_MAX)
    return fp8.astype(jnp.float8_e4m3fn), tile_exponent


def fp8_tiles_dequantize(values: jax.Array, tile_exponent: jax.Array) -> jax.Array:
    """`fp4_to_fp8`'s output back to float32 [..., rows, n]."""
    return values.astype(jnp.float32) * pow2(_per_value(tile_exponent, values.shape))


def _per_value(tile_exponent: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Tile exponents [..., ceil(rows / 128), ceil(n / 128)] -> one per value [..., rows, n]."""
    rows, n = shape[-2:]
    return jnp.repeat(jnp.repeat(tile_exponent, FP8_TILE, -2)[..., :rows, :], FP8_TILE,
                      -1)[..., :n]


def fp8_blocks(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """x [..., n] -> (E4M3 values [..., n], exponents [..., ceil(n / block)] int32)."""
    x = x.astype(jnp.float32)
    blocks = _blocked(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), 1e-4)
    exponent = pow2_exponent(amax / E4M3_MAX)
    values = jnp.clip(_scaled(blocks, exponent[..., None]), -E4M3_MAX, E4M3_MAX)
    return _unblocked(values.astype(jnp.float8_e4m3fn), x.shape[-1]), exponent


def straight_through(x: jax.Array, quantized: jax.Array) -> jax.Array:
    """quantized's values, exactly, with x's gradient (the straight-through estimator), in x's
    dtype. (x + stop_gradient(q - x) would round q - x and miss q by an ulp.)"""
    return jax.lax.stop_gradient(quantized.astype(x.dtype)) + (x - jax.lax.stop_gradient(x))


def fake_mxfp4(x: jax.Array) -> jax.Array:
    """x [..., n] through MXFP4 along its last axis and back (float32), gradient straight
    through: QAT's view of an FP4 activation (the CSA indexer's queries and keys)."""
    return straight_through(x, mx_dequantize(*mxfp4_quantize(x), MX_BLOCK))


def fake_mxfp4_weight(w: jax.Array) -> jax.Array:
    """A weight [..., in, out] (stepjax's kernel layout) as QAT computes with it (report §3.4):
    MXFP4 along `in` (the release's row blocks of the torch [out, in] weight), then FP8 tiles
    of 128 x 128, back in w's dtype with w's gradient (the FP32 master)."""
    values, exponent = mxfp4_quantize(jnp.swapaxes(w, -1, -2))
    fp8 = fp8_tiles_dequantize(*fp4_to_fp8(values, exponent))
    return straight_through(w, jnp.swapaxes(fp8, -1, -2))


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix [n, n] (n a power of two), float32: the
    release rotates the indexer's queries and keys with it before their FP4 cast, spreading
    outliers over the block; q·k is unchanged."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    matrix = np.ones((1, 1), np.float32)
    while matrix.shape[0] < n:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return matrix / np.sqrt(n, dtype=np.float32)
