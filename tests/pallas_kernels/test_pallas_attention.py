"""Pallas flash attention (interpret mode on CPU) against plain-jnp and XLA references.

Expected values come from `pallas_kernels.reference.attention_reference` (a [T, T] softmax with
explicitly repeated KV heads, the sink as an extra logit column; gradients by autodiff) and from
`model.ops.attention_cores.xla_attention` (the model's own path). Relative error is
max|actual - expected| / max(max|expected|, 1): < 1e-5 in float32, < 2e-2 with bfloat16 inputs.
Inputs and cotangents are standard normal, so every output and gradient here has max magnitude
between 1.6 and 8 and the floor never applies, except to gradients that are zero in exact
arithmetic (dq and dk at W = 1 without a sink: each query sees only itself, so dS = dO.v - dO.o
cancels), where it turns the check into |error| < 1e-5 absolute.

Unwritten outputs: most kernel runs use `debug_poison_outputs=True`, which hands every
pallas_call output in as a NaN buffer aliased to it; `test_poisoned_outputs_expose_unwritten
_blocks` shows an unwritten block does stay NaN, so "no NaN" proves every element was written.
"""

import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from model.ops.attention_cores import xla_attention
from pallas_kernels import flash_attention as fa
from pallas_kernels.attention import flash_attention_core
from pallas_kernels.flash_attention import (
    flash_attention,
    kv_block_range,
    q_block_range,
    visited_blocks,
)
from pallas_kernels.reference import attention_reference

F32_TOL, BF16_TOL = 1e-5, 2e-2


def rel_error(actual, expected) -> float:
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1.0))


def segments(length, *boundaries_per_row):
    """[B, T] segment ids; a new segment starts at each listed position of a row."""
    rows = []
    for boundaries in boundaries_per_row:
        row = np.zeros(length, np.int32)
        for start in boundaries:
            row[start:] += 1
        rows.append(row)
    return jnp.asarray(np.stack(rows))


def inputs(seed, batch, length, heads, kv_heads, head_dim, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (batch, length, heads, head_dim)).astype(dtype)
    k = jax.random.normal(keys[1], (batch, length, kv_heads, head_dim)).astype(dtype)
    v = jax.random.normal(keys[2], (batch, length, kv_heads, head_dim)).astype(dtype)
    sink = jax.random.normal(keys[3], (heads,))
    cotangent = jax.random.normal(keys[4], (batch, length, heads, head_dim))
    return q, k, v, sink, cotangent


def value_and_grads(core, q, k, v, sink, cotangent, *, window, segment_ids):
    """(output, (dq, dk, dv, dsink)) of <core(...), cotangent>; dsink is None without a sink."""

    def loss(q, k, v, sink):
        out = core(q, k, v, window=window, segment_ids=segment_ids, sink=sink)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    argnums = (0, 1, 2) if sink is None else (0, 1, 2, 3)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(q, k, v, sink)
    return out, tuple(grads) + (None,) * (4 - len(grads))


def kernel(block_q, block_k, poison=True):
    def core(q, k, v, **kw):
        return flash_attention(q, k, v, block_q=block_q, block_k=block_k, interpret=True,
                               debug_poison_outputs=poison, **kw)

    return core


def assert_matches(actual, expected, tol, what):
    out, grads = actual
    ref_out, ref_grads = expected
    assert out.dtype == ref_out.dtype
    assert not np.isnan(np.asarray(out, np.float32)).any(), f"{what}: NaN in output"
    assert rel_error(out, ref_out) < tol, (what, "out", rel_error(out, ref_out))
    for name, grad, ref_grad in zip(("dq", "dk", "dv", "dsink"), grads, ref_grads):
        if ref_grad is None:
            continue
        assert grad.dtype == ref_grad.dtype, (what, name, grad.dtype, ref_grad.dtype)
        assert not np.isnan(np.asarray(grad, np.float32)).any(), f"{what}: NaN in {name}"
        err = rel_error(grad, ref_grad)
        assert err < tol, (what, name, err)


# (window, T, block_q, block_k, heads, kv_heads, segment boundaries or None, sink?)
F32_CASES = {
    "full_gqa_seg_sink": (None, 40, 16, 16, 4, 2, ((16, 21, 23), (3, 30)), True),
    "swa5_tq16_tk8": (5, 37, 16, 8, 4, 2, ((16, 21, 23), (3, 30)), True),
    "swa1": (1, 33, 16, 16, 2, 2, None, False),
    "swa1_seg_sink": (1, 33, 16, 16, 4, 2, ((16,), (1, 2)), True),
    "window_ge_T": (80, 48, 16, 32, 4, 2, None, True),
    "swa20_g4_tq32_tk16": (20, 64, 32, 16, 4, 1, ((7, 32, 33), (40,)), False),
    "swa12_plain": (12, 50, 16, 16, 2, 1, None, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(F32_CASES))
def test_float32_matches_reference_and_xla(case):
    window, length, block_q, block_k, heads, kv_heads, boundaries, with_sink = F32_CASES[case]
    q, k, v, sink, cotangent = inputs(len(case), 2, length, heads, kv_heads, 16)
    sink = sink if with_sink else None
    segment_ids = None if boundaries is None else segments(length, *boundaries)
    kw = dict(window=window, segment_ids=segment_ids)
    actual = value_and_grads(kernel(block_q, block_k), q, k, v, sink, cotangent, **kw)
    reference = value_and_grads(attention_reference, q, k, v, sink, cotangent, **kw)
    assert_matches(actual, reference, F32_TOL, f"{case} vs reference")
    xla = value_and_grads(xla_attention, q, k, v, sink, cotangent, **kw)
    assert_matches(actual, xla, F32_TOL, f"{case} vs xla_attention")


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 7])
def test_bfloat16_inputs(window):
    q, k, v, sink, cotangent = inputs(3, 2, 45, 4, 2, 32, jnp.bfloat16)
    kw = dict(window=window, segment_ids=segments(45, (20,), (5, 33)))
    actual = value_and_grads(kernel(16, 16), q, k, v, sink, cotangent, **kw)
    reference = value_and_grads(attention_reference, q, k, v, sink, cotangent, **kw)
    assert actual[0].dtype == jnp.bfloat16
    assert_matches(actual, reference, BF16_TOL, "bf16 vs reference")
    xla = value_and_grads(xla_attention, q, k, v, sink, cotangent, **kw)
    assert_matches(actual, xla, BF16_TOL, "bf16 vs xla_attention")


@pytest.mark.slow
def test_sink_minus_infinity_equals_no_sink():
    q, k, v, _, cotangent = inputs(4, 1, 30, 4, 2, 16)
    kw = dict(window=6, segment_ids=None)
    no_sink = value_and_grads(kernel(16, 16, poison=False), q, k, v, None, cotangent, **kw)
    minus_inf = jnp.full((4,), -jnp.inf)
    with_sink = value_and_grads(kernel(16, 16, poison=False), q, k, v, minus_inf, cotangent, **kw)
    np.testing.assert_array_equal(with_sink[0], no_sink[0])
    for grad, ref in zip(with_sink[1][:3], no_sink[1][:3]):
        np.testing.assert_array_equal(grad, ref)
    np.testing.assert_array_equal(with_sink[1][3], np.zeros(4, np.float32))


@pytest.mark.slow
def test_registry_core_matches_xla_with_default_blocks():
    """The AttentionCore signature, default blocks and interpret=None (CPU -> interpret)."""
    assert inspect.signature(flash_attention_core) == inspect.signature(xla_attention)
    q, k, v, sink, _ = inputs(5, 1, 24, 4, 2, 16)
    segment_ids = segments(24, (9,))
    for window in (None, 4):
        kw = dict(window=window, segment_ids=segment_ids, sink=sink)
        out = jax.jit(lambda q, k, v: flash_attention_core(q, k, v, **kw))(q, k, v)
        assert rel_error(out, xla_attention(q, k, v, **kw)) < F32_TOL


def test_poisoned_outputs_expose_unwritten_blocks():
    """The poisoning used above is meaningful: a grid step that writes nothing leaves NaN."""
    cfg = fa._Config(seq_len=8, window=None, block_q=4, block_k=4, interpret=True,
                     backend="cpu", poison=True)

    def skips_second_block(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = x_ref[...]

    spec = pl.BlockSpec((4,), lambda i: (i,))
    (out,) = fa._pallas_call(skips_second_block, cfg, name="probe", grid=(2,), in_specs=[spec],
                             out_specs=[spec], out_shape=[jax.ShapeDtypeStruct((8,), jnp.float32)],
                             args=(jnp.arange(8.0),), head_dim=1)
    np.testing.assert_array_equal(np.isnan(out), [False] * 4 + [True] * 4)


def test_bad_arguments_raise():
    q, k, v, _, _ = inputs(6, 1, 8, 4, 2, 16)
    with pytest.raises(ValueError, match="window"):
        flash_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="k/v"):
        flash_attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
    with pytest.raises(ValueError, match="sink"):
        flash_attention(q, k, v, sink=jnp.zeros(3))
    with pytest.raises(ValueError, match="block_q"):
        flash_attention(q, k, v, block_q=0)


# ---- lowering (no accelerator here: lower for the platform without compiling) -----------------


@pytest.mark.parametrize("dtype,window,extras", [(jnp.bfloat16, 512, True),
                                                 (jnp.float32, None, False)])
def test_lowers_to_triton_for_gpu(monkeypatch, dtype, window, extras):
    """Forward, dq and dk/dv kernels go through the Pallas Triton lowering (power-of-two tiles,
    supported ops) for CUDA at a model-like shape: T = 1000 (padded), D = 128, G = 12."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    batch, length, heads, kv_heads, head_dim = 1, 1000, 24, 2, 128
    q = jax.ShapeDtypeStruct((batch, length, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((batch, length, kv_heads, head_dim), dtype)
    segment_ids = jax.ShapeDtypeStruct((batch, length), jnp.int32) if extras else None
    sink = jax.ShapeDtypeStruct((heads,), jnp.float32) if extras else None

    def forward_backward(q, k, v, segment_ids, sink):
        def attention(q, k, v, sink):
            return flash_attention(q, k, v, window=window, segment_ids=segment_ids, sink=sink,
                                   interpret=False)

        out, vjp = jax.vjp(attention, q, k, v, sink)
        return out, vjp(out)

    lowered = jax.jit(forward_backward).trace(q, kv, kv, segment_ids, sink).lower(
        lowering_platforms=("cuda",)).as_text()
    for name in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"):
        assert f'name = "{name}"' in lowered, name
    assert lowered.count("xla.gpu.triton") == 3
    assert lowered.count("num_warps = 8 : i32") == 3  # 64 x 64 blocks at D = 128


def test_compiled_mode_checks(monkeypatch):
    q, k, v, _, _ = inputs(7, 1, 8, 4, 2, 16)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="power of two"):
        flash_attention(q, k, v, block_q=24, interpret=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(NotImplementedError, match="TPU"):
        flash_attention(q, k, v, interpret=False)


# ---- block skipping -----------------------------------------------------------------------


def brute_force_pairs(length, window, block_q, block_k):
    """Block pairs holding at least one visible (i, j), straight from the masking rule."""
    i = np.arange(length)[:, None]
    j = np.arange(length)[None, :]
    visible = (j <= i) & ((i - j < window) if window is not None else True)
    return {(a // block_q, b // block_k) for a, b in zip(*np.nonzero(visible))}


@pytest.mark.parametrize("length", [1, 5, 16, 37, 64, 100])
def test_visited_blocks_equals_brute_force(length):
    for window, block_q, block_k in itertools.product(
        (None, 1, 3, 16, 17, 40, 200), (8, 16, 32), (8, 16, 32)
    ):
        expected = brute_force_pairs(length, window, block_q, block_k)
        args = (block_q, block_k, window, length)
        by_q = {(a, b) for a in range(pl.cdiv(length, block_q))
                for b in range(kv_block_range(a, *args)[0], kv_block_range(a, *args)[1] + 1)}
        by_kv = {(a, b) for b in range(pl.cdiv(length, block_k))
                 for a in range(q_block_range(b, *args)[0], q_block_range(b, *args)[1] + 1)}
        assert by_q == expected, (length, window, block_q, block_k)
        assert by_kv == expected, (length, window, block_q, block_k)
        assert visited_blocks(length, window, block_q, block_k) == len(expected)


def test_block_ranges_trace_like_python_ints():
    """The kernels call the same functions on traced int32 block indices."""
    for window in (None, 5, 40):
        traced = jax.jit(lambda i: kv_block_range(i, 16, 8, window, 100))(jnp.int32(3))
        assert tuple(int(x) for x in traced) == kv_block_range(3, 16, 8, window, 100)
        traced = jax.jit(lambda j: q_block_range(j, 16, 8, window, 100))(jnp.int32(4))
        assert tuple(int(x) for x in traced) == q_block_range(4, 16, 8, window, 100)


def test_visited_blocks_linear_for_swa_quadratic_for_full():
    lengths = [2048 * n for n in range(1, 9)]
    swa = [visited_blocks(t, 512, 128, 128) for t in lengths]
    full = [visited_blocks(t, None, 128, 128) for t in lengths]
    assert len(set(np.diff(swa))) == 1  # constant increment: linear in T
    assert swa[0] == 5 * 16 - 10  # 5 KV blocks per query block (W/128 + 1), fewer at the start
    assert len(set(np.diff(full, n=2))) == 1 and np.diff(full, n=2)[0] > 0  # quadratic
    assert all(f == (t // 128) * (t // 128 + 1) // 2 for f, t in zip(full, lengths))
