"""RoPE (rotate-half, partial, llama3 / YaRN scaling) and zero-centred RMSNorm vs float64 numpy.

References are written here from the published definitions, not from `model/`:
- rotate-half RoPE as complex multiplication of the pairs (x_i, x_{i + r/2}) by e^{i p f_i};
- Llama-3.1 scaling and YaRN "NTK-by-parts" as in Hugging Face transformers'
  `_compute_llama3_parameters` / `_compute_yarn_parameters`, written as per-frequency loops,
  plus the YaRN paper's region properties checked separately;
- RMSNorm y = x / sqrt(mean(x^2) + eps) * (1 + w) (docs/architecture.md, "Exact semantics").
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import RopeScaling
from model.layers.norm import RMSNorm
from model.layers.rope import apply_rope, rope_frequencies


def assert_close(actual, expected, tol=1e-5, err_msg=""):
    """|actual - expected| <= tol * (|expected| + max|expected|): relative to the magnitude."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=err_msg)


# ---- references -----------------------------------------------------------------------------


def plain_inv_freq(rotary_dims, theta):
    return np.array([1.0 / theta ** (2 * i / rotary_dims) for i in range(rotary_dims // 2)])


def llama3_inv_freq(rotary_dims, theta, factor, original_max_len, low_freq_factor, high_freq_factor):
    """Llama 3.1: wavelengths above L/low are divided by `factor`, below L/high kept, and in
    between interpolated with smooth = (L / wavelength - low) / (high - low)."""
    out = []
    for f in plain_inv_freq(rotary_dims, theta):
        wavelength = 2 * math.pi / f
        if wavelength < original_max_len / high_freq_factor:
            out.append(f)
        elif wavelength > original_max_len / low_freq_factor:
            out.append(f / factor)
        else:
            smooth = (original_max_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def yarn_inv_freq(rotary_dims, theta, factor, original_max_len, beta_fast, beta_slow):
    """YaRN NTK-by-parts as in HF: the pair index at which a frequency completes r rotations over
    the original context bounds a linear ramp (floor / ceil, clamped to [0, dim-1]) from keeping
    the frequency (fast, many rotations) to dividing it by `factor` (slow)."""

    def pair_index_with_rotations(r):
        # Solve original_max_len * theta^(-2i/d) / (2 pi) = r for i.
        return rotary_dims * math.log(original_max_len / (2 * math.pi * r)) / (2 * math.log(theta))

    low = max(math.floor(pair_index_with_rotations(beta_fast)), 0)
    high = min(math.ceil(pair_index_with_rotations(beta_slow)), rotary_dims - 1)
    if high == low:
        high += 0.001
    out = []
    for i, f in enumerate(plain_inv_freq(rotary_dims, theta)):
        interpolate = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append((1 - interpolate) * f + interpolate * f / factor)
    attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return np.array(out), attention_factor


def reference_rope(x, positions, rotary_dims, inv_freq, multiplier=1.0):
    """Pairs (i, i + r/2) as complex numbers times multiplier * e^{i * position * f_i}."""
    x = np.asarray(x, np.float64)
    half = rotary_dims // 2
    z = x[..., :half] + 1j * x[..., half:rotary_dims]
    phase = multiplier * np.exp(1j * np.asarray(positions, np.float64)[:, :, None, None] * inv_freq)
    z = z * phase
    return np.concatenate([z.real, z.imag, x[..., rotary_dims:]], axis=-1)


def reference_rms(x, w, eps=1e-5):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * (1.0 + np.asarray(w, np.float64))


NONE = RopeScaling()
LLAMA31 = RopeScaling(type="llama3", factor=8.0, original_max_len=8192, low_freq_factor=1.0,
                      high_freq_factor=4.0)
YARN = RopeScaling(type="yarn", factor=4.0, original_max_len=4096, beta_fast=32.0, beta_slow=1.0)


def rope_inputs(head_dim=16, seed=0, max_position=40):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 12, 3, head_dim)).astype(np.float32)
    positions = rng.integers(0, max_position, size=(2, 12)).astype(np.int32)
    return x, positions


# ---- apply_rope -----------------------------------------------------------------------------

# Positions < 40: float32 angles p * f are rounded to ~2e-6 rad, well inside the 1e-5 tolerance.


@pytest.mark.parametrize("rotary_dims,theta", [(16, 1e4), (8, 5e6), (4, 500.0), (2, 1e4)])
def test_apply_rope_matches_reference(rotary_dims, theta):
    x, positions = rope_inputs()
    out = jax.jit(apply_rope, static_argnums=(2, 3, 4))(x, positions, rotary_dims, theta, NONE)
    assert out.dtype == jnp.float32 and out.shape == x.shape
    expected = reference_rope(x, positions, rotary_dims, plain_inv_freq(rotary_dims, theta))
    assert_close(out, expected)
    # Dims past rotary_dims pass through bit for bit.
    np.testing.assert_array_equal(np.asarray(out)[..., rotary_dims:], x[..., rotary_dims:])


def test_apply_rope_zero_rotary_dims_and_position_zero_are_identity():
    x, positions = rope_inputs()
    np.testing.assert_array_equal(np.asarray(apply_rope(x, positions, 0, 1e4, NONE)), x)
    zeros = np.zeros_like(positions)
    np.testing.assert_allclose(np.asarray(apply_rope(x, zeros, 16, 1e4, NONE)), x, rtol=0, atol=1e-7)


@pytest.mark.parametrize("rotary_dims", [8, 16])
def test_apply_rope_preserves_norm_of_each_rotate_half_pair(rotary_dims):
    x, positions = rope_inputs(seed=1, max_position=5000)
    out = np.asarray(apply_rope(x, positions, rotary_dims, 1e4, NONE), np.float64)
    half = rotary_dims // 2
    pair_norm = lambda a: a[..., :half] ** 2 + a[..., half:rotary_dims] ** 2
    assert_close(pair_norm(out), pair_norm(x.astype(np.float64)))


def test_apply_rope_depends_only_on_relative_position():
    rng = np.random.default_rng(2)
    q = rng.normal(size=(1, 1, 1, 16)).astype(np.float32)
    k = rng.normal(size=(1, 1, 1, 16)).astype(np.float32)

    def score(m, n):
        qm = apply_rope(q, np.array([[m]], np.int32), 16, 1e4, NONE)
        kn = apply_rope(k, np.array([[n]], np.int32), 16, 1e4, NONE)
        return float(jnp.sum(qm * kn))

    scale = float(np.linalg.norm(q) * np.linalg.norm(k))
    for m, n in [(5, 2), (9, 9), (3, 30)]:
        base = score(m, n)
        for shift in (1, 7, 23, 100):
            # Positions up to ~130: float32 angle rounding ~1e-5 rad, so 5e-5 of |q||k|.
            assert abs(score(m + shift, n + shift) - base) <= 5e-5 * scale, (m, n, shift)
        # Control: changing the difference changes the score.
        assert abs(score(m + 1, n) - base) > 1e-3 * scale


def test_apply_rope_bfloat16_input():
    x, positions = rope_inputs(seed=3)
    xb = jnp.asarray(x, jnp.bfloat16)
    out = apply_rope(xb, positions, 16, 1e4, NONE)
    assert out.dtype == jnp.bfloat16
    expected = reference_rope(np.asarray(xb, np.float64), positions, 16, plain_inv_freq(16, 1e4))
    # One bfloat16 rounding of a float32 result: |err| <= 2^-8 |value| (+ tiny absolute slack).
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("scaling", [LLAMA31, YARN], ids=["llama3", "yarn"])
def test_apply_rope_with_scaling_matches_reference(scaling):
    x, positions = rope_inputs(head_dim=64, seed=4)
    out = apply_rope(x, positions, 64, 1e4, scaling)
    if scaling.type == "llama3":
        inv_freq, multiplier = llama3_inv_freq(64, 1e4, 8.0, 8192, 1.0, 4.0), 1.0
    else:
        # HF convention: the YaRN attention factor multiplies cos and sin (rotated dims only).
        inv_freq, multiplier = yarn_inv_freq(64, 1e4, 4.0, 4096, 32.0, 1.0)
    assert_close(out, reference_rope(x, positions, 64, inv_freq, multiplier))


# ---- frequencies ----------------------------------------------------------------------------


@pytest.mark.parametrize("rotary_dims,theta", [(128, 1e4), (64, 5e6), (4, 500.0)])
def test_plain_frequencies(rotary_dims, theta):
    inv_freq, multiplier = rope_frequencies(rotary_dims, theta, NONE)
    np.testing.assert_allclose(inv_freq, plain_inv_freq(rotary_dims, theta), rtol=1e-12)
    assert multiplier == 1.0


LLAMA3_CASES = [
    # (rotary_dims, theta, factor, original_max_len, low_freq_factor, high_freq_factor)
    (128, 500_000.0, 8.0, 8192, 1.0, 4.0),  # Llama 3.1 8B
    (64, 5_000_000.0, 4.0, 4096, 1.0, 4.0),
    (16, 500.0, 8.0, 64, 1.0, 4.0),
    (32, 10_000.0, 2.0, 1024, 2.0, 8.0),
]


@pytest.mark.parametrize("case", LLAMA3_CASES)
def test_llama3_frequencies(case):
    rotary_dims, theta, factor, original, low, high = case
    scaling = RopeScaling(type="llama3", factor=factor, original_max_len=original,
                          low_freq_factor=low, high_freq_factor=high)
    inv_freq, multiplier = rope_frequencies(rotary_dims, theta, scaling)
    expected = llama3_inv_freq(rotary_dims, theta, factor, original, low, high)
    np.testing.assert_allclose(inv_freq, expected, rtol=1e-12)
    assert multiplier == 1.0


def test_llama3_frequencies_cover_all_three_regions():
    """Guards the test cases above: the Llama 3.1 case has kept, divided and smoothed entries."""
    plain = plain_inv_freq(128, 500_000.0)
    scaled = llama3_inv_freq(128, 500_000.0, 8.0, 8192, 1.0, 4.0)
    kept, divided = np.isclose(scaled, plain), np.isclose(scaled, plain / 8)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


YARN_CASES = [
    # (rotary_dims, theta, factor, original_max_len, beta_fast, beta_slow)
    (64, 10_000.0, 4.0, 4096, 32.0, 1.0),
    (128, 5_000_000.0, 16.0, 4096, 32.0, 1.0),
    (8, 10_000.0, 8.0, 256, 32.0, 1.0),  # ramp clamped at the low end
    (32, 10_000.0, 2.5, 2048, 16.0, 2.0),
]


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_frequencies(case):
    rotary_dims, theta, factor, original, beta_fast, beta_slow = case
    scaling = RopeScaling(type="yarn", factor=factor, original_max_len=original,
                          beta_fast=beta_fast, beta_slow=beta_slow)
    inv_freq, multiplier = rope_frequencies(rotary_dims, theta, scaling)
    expected, attention_factor = yarn_inv_freq(rotary_dims, theta, factor, original, beta_fast, beta_slow)
    np.testing.assert_allclose(inv_freq, expected, rtol=1e-12)
    np.testing.assert_allclose(multiplier, attention_factor, rtol=1e-12)


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_paper_regions(case):
    """YaRN paper (Peng et al. 2023, NTK-by-parts): frequencies that complete >= beta_fast
    rotations within the original context are unchanged, those with <= beta_slow rotations are
    divided by the factor (position interpolation), everything in between lies between the two;
    attention temperature sqrt(1/t) = 0.1 ln(s) + 1."""
    rotary_dims, theta, factor, original, beta_fast, beta_slow = case
    scaling = RopeScaling(type="yarn", factor=factor, original_max_len=original,
                          beta_fast=beta_fast, beta_slow=beta_slow)
    inv_freq, multiplier = rope_frequencies(rotary_dims, theta, scaling)
    plain = plain_inv_freq(rotary_dims, theta)
    rotations = original * plain / (2 * math.pi)
    fast, slow = rotations >= beta_fast, rotations <= beta_slow
    np.testing.assert_allclose(inv_freq[fast], plain[fast], rtol=1e-12)
    np.testing.assert_allclose(inv_freq[slow], plain[slow] / factor, rtol=1e-12)
    assert np.all(inv_freq <= plain * (1 + 1e-12)) and np.all(inv_freq >= plain / factor * (1 - 1e-12))
    assert np.isclose(multiplier, 0.1 * math.log(factor) + 1.0)


@pytest.mark.parametrize("scaling", [
    RopeScaling(type="llama3", factor=1.0, original_max_len=64),
    RopeScaling(type="yarn", factor=1.0, original_max_len=64),
    RopeScaling(type="none", factor=8.0),  # type none ignores the other fields
], ids=["llama3-factor1", "yarn-factor1", "none-factor8"])
def test_unit_scaling_equals_plain(scaling):
    inv_freq, multiplier = rope_frequencies(32, 1e4, scaling)
    np.testing.assert_allclose(inv_freq, plain_inv_freq(32, 1e4), rtol=1e-12)
    assert multiplier == 1.0
    x, positions = rope_inputs(head_dim=32, seed=5)
    np.testing.assert_array_equal(
        np.asarray(apply_rope(x, positions, 32, 1e4, scaling)),
        np.asarray(apply_rope(x, positions, 32, 1e4, NONE)),
    )


# ---- RMSNorm --------------------------------------------------------------------------------


def test_rmsnorm_matches_float64_reference():
    rng = np.random.default_rng(0)
    x = rng.normal(scale=3.0, size=(3, 5, 16)).astype(np.float32)
    w = rng.normal(scale=0.5, size=16).astype(np.float32)
    out = RMSNorm().apply({"params": {"weight": w}}, x)
    assert out.dtype == jnp.float32 and out.shape == x.shape
    assert_close(out, reference_rms(x, w))


def test_rmsnorm_init_is_zero_offset_plain_rms_normalisation():
    rng = np.random.default_rng(1)
    # Last-axis scales 1e-3 .. 10: at 1e-3 the eps=1e-5 term dominates mean(x^2) ~ 1e-6.
    x = (rng.normal(size=(4, 32)) * np.array([1e-3, 1e-2, 1.0, 10.0])[:, None]).astype(np.float32)
    variables = RMSNorm().init(jax.random.key(0), x)
    weight = variables["params"]["weight"]
    weight = getattr(weight, "value", weight)  # logical-partitioning box
    np.testing.assert_array_equal(np.asarray(weight), np.zeros(32, np.float32))
    out = RMSNorm().apply(variables, x)
    x64 = x.astype(np.float64)
    assert_close(out, x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-5))


def test_rmsnorm_custom_eps_and_axis_name():
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(2, 8)) * 1e-2).astype(np.float32)
    norm = RMSNorm(eps=1e-3, axis_name="head_dim")
    variables = norm.init(jax.random.key(0), x)
    assert variables["params"]["weight"].names == ("head_dim",)
    assert_close(norm.apply(variables, x), reference_rms(x, np.zeros(8), eps=1e-3))


def test_rmsnorm_bfloat16_input_is_computed_in_float32():
    rng = np.random.default_rng(3)
    xb = jnp.asarray(rng.normal(scale=2.0, size=(4, 64)), jnp.bfloat16)
    w = rng.normal(scale=0.5, size=64).astype(np.float32)
    expected = reference_rms(np.asarray(xb, np.float64), w)
    # dtype float32: the result must be float32-accurate for the bf16-valued input (a bf16
    # computation would be off by ~1e-2 relative).
    out32 = RMSNorm(dtype=jnp.float32).apply({"params": {"weight": w}}, xb)
    assert out32.dtype == jnp.float32
    assert_close(out32, expected)
    # dtype bfloat16: one final rounding, |err| <= 2^-8 |value|.
    out16 = RMSNorm(dtype=jnp.bfloat16).apply({"params": {"weight": w}}, xb)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out16, np.float64), expected, rtol=2**-8, atol=1e-30)
