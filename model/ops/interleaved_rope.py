"""DeepSeek-V4's partial RoPE (report §2.3.3, "Partial RoPE"): the *interleaved* convention
(channel pairs (2i, 2i+1) rotate together) on the *trailing* `2 * len(inv_freq)` channels of
each vector; the leading channels pass through. Step 3.5's rotate-half RoPE on the leading
channels is `model.layers.rope.apply_rope`; the two conventions are not interchangeable.

The frequencies come from the caller (`model.layers.rope.rope_frequencies` gives plain, YaRN
and llama3 ones), so the same function serves queries, sliding-window entries, compressed
entries (at their block-start position) and the inverse rotation of the attention output
(`positions=-positions`: rotating by -θ undoes +θ).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.ops.rope_tables import rotation_tables


def rotate_trailing_pairs(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x: [B, T, ..., D]; positions: [B, T] (int or float); inv_freq: [R/2] -> [B, T, ..., D]
    in x.dtype, the last R channels rotated by position·inv_freq (math in float32)."""
    half = inv_freq.shape[-1]
    if half == 0:
        return x
    angles = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
    angles = angles.reshape(*angles.shape[:2], *([1] * (x.ndim - 3)), half)  # heads broadcast
    cos, sin = rotation_tables(angles)
    keep, rot = x[..., :-2 * half], x[..., -2 * half:].astype(jnp.float32)
    pairs = rot.reshape(*rot.shape[:-1], half, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return jnp.concatenate([keep, rotated.reshape(rot.shape).astype(x.dtype)], axis=-1)
