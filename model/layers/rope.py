"""Rotary position embeddings (docs/architecture.md, "Exact semantics").

Rotate-half (NeoX) convention on the first `rotary_dims` dims of each head; the remaining dims
pass through unchanged (partial RoPE: 64 of 128 dims on full layers, all 128 on SWA layers).
Context-extension scaling (YaRN or llama3-style) is computed here and applied by the caller to
full-attention layers only.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from model.config import RopeScaling
from model.ops.rope_tables import rotation_tables


def _yarn(inv_freq: np.ndarray, rotary_dims: int, theta: float, s: RopeScaling):
    """YaRN "NTK-by-parts" frequencies and attention temperature (Peng et al. 2023, eqs. 17-23)."""

    def correction_dim(num_rotations: float) -> float:
        return rotary_dims * math.log(s.original_max_len / (num_rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), rotary_dims - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(rotary_dims // 2) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp  # 1 keeps the original (high) frequency, 0 interpolates
    scaled = inv_freq * (1 - extrapolate) / s.factor + inv_freq * extrapolate
    temperature = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
    return scaled, temperature


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama-3.1 scaling: long wavelengths divided by `factor`, short kept, smooth in between."""
    low_freq_wavelen = s.original_max_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return np.where(
        wavelen > low_freq_wavelen,
        inv_freq / s.factor,
        np.where(wavelen < high_freq_wavelen, inv_freq, smoothed),
    )


def rope_frequencies(rotary_dims: int, theta: float, scaling: RopeScaling) -> tuple[np.ndarray, float]:
    """Returns (inverse frequencies [rotary_dims // 2] float64, cos/sin multiplier)."""
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dims, 2, dtype=np.float64) / rotary_dims)
    if scaling.type == "yarn":
        return _yarn(inv_freq, rotary_dims, theta, scaling)
    if scaling.type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return inv_freq, 1.0


def apply_rope(
    x: jax.Array, positions: jax.Array, rotary_dims: int, theta: float, scaling: RopeScaling
) -> jax.Array:
    """Rotates the first `rotary_dims` dims of each head.

    x: [B, T, H, D]; positions: [B, T] int. Returns [B, T, H, D] in x.dtype (math in float32).
    """
    if rotary_dims == 0:
        return x
    inv_freq, multiplier = rope_frequencies(rotary_dims, theta, scaling)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = rotation_tables(angles, multiplier)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, rotary_dims/2]
    rot, rest = x[..., :rotary_dims].astype(jnp.float32), x[..., rotary_dims:]
    first, second = jnp.split(rot, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return jnp.concatenate([rotated.astype(x.dtype), rest], axis=-1)
