"""The FP8 KV-cache layout (model/inference/kv_storage.py, `KVCacheSpec.fp8`) against a numpy
reference of DeepSeek-V4's: the channels outside the RoPE range as E4M3 (ml_dtypes) in blocks of
64 with scale 2^ceil(log2(max(amax, 1e-4) / 448)), the RoPE channels untouched; and GQA decoding
through it (model/inference/kv_cache.py) equal to plain decoding of keys and values that went
through the reference first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from model.inference.kv_cache import attend_and_update, empty_layer_cache
from model.inference.kv_storage import RowFormat


def fp8_reference(x: np.ndarray, kept: tuple[int, int]) -> np.ndarray:
    lo, hi = kept
    rest = np.concatenate([x[..., :lo], x[..., hi:]], -1).astype(np.float32)
    n = rest.shape[-1]
    blocks = np.pad(rest, [(0, 0)] * (x.ndim - 1) + [(0, -n % 64)]).reshape(
        *rest.shape[:-1], -1, 64)
    amax = np.maximum(np.abs(blocks).max(-1, keepdims=True), np.float32(1e-4)) / np.float32(448)
    scale = 2.0 ** np.ceil(np.log2(amax.astype(np.float64)))
    rounded = (blocks / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
    rest = rounded.reshape(*rest.shape[:-1], -1)[..., :n]
    return np.concatenate([rest[..., :lo], x[..., lo:hi], rest[..., lo:]], -1).astype(np.float32)


@pytest.mark.parametrize("kept", [(0, 0), (0, 16), (80, 96)])  # none, GQA keys, V4 entries
def test_rows_round_trip_as_the_reference(kept):
    x = np.random.default_rng(0).standard_normal((2, 3, 96)) * np.array([[[1e-3]], [[50.0]]])
    x = x.astype(np.float32)
    fmt = RowFormat(True, kept)
    stored = jax.jit(fmt.encode)(jnp.asarray(x))
    assert stored.values.dtype == jnp.float8_e4m3fn and stored.kept.shape[-1] == kept[1] - kept[0]
    assert stored.exponents.shape[-1] == -(-(96 - kept[1] + kept[0]) // 64)
    np.testing.assert_array_equal(fmt.decode(stored, jnp.float32), fp8_reference(x, kept))
    # a cache with no rows (a compressed layer whose rate exceeds max_len)
    assert fmt.decode(fmt.empty((2, 0, 96), jnp.float32), jnp.float32).shape == (2, 0, 96)


def test_gqa_decoding_reads_keys_and_values_as_stored():
    """Two chunks (5 then 3 tokens) of GQA keys with 8 leading RoPE channels: the FP8 cache's
    attention output equals the plain cache's on reference-rounded keys and values, and the
    cache holds the rounded rows."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 8, h, 32)).astype(np.float32) for h in (4, 2, 2))
    formats = (RowFormat(True, (0, 8)), RowFormat(True))
    rounded = fp8_reference(k, (0, 8)), fp8_reference(v, (0, 0))

    @functools.partial(jax.jit, static_argnums=3)
    def decode(q, k, v, formats=formats):
        cache = empty_layer_cache(1, 16, 2, 32, jnp.float32, formats=formats)
        outputs = []
        for chunk in (slice(0, 5), slice(5, 8)):
            positions = jnp.arange(8)[None, chunk]
            out, cache = attend_and_update(q[:, chunk], k[:, chunk], v[:, chunk], positions,
                                           cache, window=None, sink=None, formats=formats)
            outputs.append(out)
        return jnp.concatenate(outputs, 1), cache

    got, cache = decode(q, k, v)
    want, _ = decode(q, *rounded, (RowFormat(), RowFormat()))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(formats[0].decode(cache.key, jnp.float32)[:, :8], rounded[0])
    np.testing.assert_array_equal(formats[1].decode(cache.value, jnp.float32)[:, :8],
                                  rounded[1])
    plain, _ = decode(q, k, v, (RowFormat(), RowFormat()))
    assert not np.allclose(got, plain, rtol=1e-5, atol=1e-5)  # the rounding is visible
