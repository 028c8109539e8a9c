"""Attention cores (xla, dense, local, cudnn), their gradients and the head-wise gate as a sink
(report A.1, eq. 6), against the float64 references of tests/attention_references.py.

Every expected value here is computed independently of `model/`: numpy float64 with an explicit
per-query list of visible keys (query i sees key j iff j <= i, i - j < W and same segment),
KV heads repeated explicitly for GQA (query head h uses KV head h // G), and the sink written
as one extra softmax logit whose value vector is zero.

Tolerances: float32 kernels vs float64 references agree to ~1e-6 relative; tests use 1e-5
(relative to the reference's magnitude) unless a comment says otherwise.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_references import (
    assert_close,
    jnp_reference_attention,
    reference_attention,
    segments_from_boundaries,
    sigmoid,
    visibility_mask,
    visible_keys,
)

from model.ops import attention_vjp
from model.ops.attention_cores import (
    MIN_CHUNK,
    dense_attention,
    local_attention,
    masked_attention,
    xla_attention,
)
from model.ops.cudnn_attention import cudnn_attention
from model.ops.tables import ATTENTION, MOE

# ---- attention cores ------------------------------------------------------------------------

BATCH, KV_HEADS, GROUPS, HEAD_DIM = 2, 2, 3, 8
HEADS = KV_HEADS * GROUPS
F32, BF16 = jnp.float32, jnp.bfloat16


def make_qkv(length, seed):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(BATCH, length, HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.normal(size=(BATCH, length, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.normal(size=(BATCH, length, KV_HEADS, HEAD_DIM)).astype(np.float32)
    return q, k, v


def make_segments(length):
    """Row 0: boundaries inside chunks and exactly on / next to the chunk edge (128); row 1:
    different boundaries, including a one-token document."""
    row0 = segments_from_boundaries(length, [b for b in (3, 100, 127, 128, 129, 200, 290) if b < length])
    row1 = segments_from_boundaries(length, [b for b in (50, 51, 170) if b < length])
    return np.stack([row0, row1])


def make_sink(seed):
    # Mixed signs and magnitudes so the sink changes outputs noticeably (up to e^2.5 of mass).
    return np.random.default_rng(seed).uniform(-2.0, 2.5, size=HEADS).astype(np.float32)


# (length, window, with segments, with sink). MIN_CHUNK=128: T=300 gives 3 chunks of 128 for
# W <= 128 and of W for W > 128; 256 is an exact multiple; W >= T falls back to the dense path.
CORE_CASES = [
    (37, None, False, False),
    (37, None, True, True),
    (300, None, True, True),
    (37, 5, True, True),
    (300, 5, False, False),
    (300, 5, True, True),
    (300, 130, False, True),
    (300, 130, True, False),
    (256, 128, True, True),
    (300, 1, True, True),
    (300, 300, True, True),
    (300, 1000, False, True),
]

CORES = {
    "xla": xla_attention,
    "dense": dense_attention,
    "local": local_attention,
    "cudnn": cudnn_attention,
}


def core_params():
    for case in CORE_CASES:
        length, window, seg, sink = case
        for name in CORES:
            if name == "local" and window is None:
                continue  # local_attention is the windowed path only
            yield pytest.param(name, case, id=f"{name}-T{length}-W{window}-seg{int(seg)}-sink{int(sink)}")


@functools.lru_cache(maxsize=None)
def core_case_data(case):
    length, window, with_seg, with_sink = case
    q, k, v = make_qkv(length, seed=length + (window or 0))
    segment_ids = make_segments(length) if with_seg else None
    sink = make_sink(seed=length) if with_sink else None
    expected = reference_attention(q, k, v, window, segment_ids, sink)
    return q, k, v, segment_ids, sink, expected


def run_core(core, q, k, v, window, segment_ids, sink):
    fn = jax.jit(core, static_argnames="window")
    return fn(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), window=window,
        segment_ids=None if segment_ids is None else jnp.asarray(segment_ids),
        sink=None if sink is None else jnp.asarray(sink),
    )


@pytest.mark.parametrize("core_name,case", list(core_params()))
def test_core_matches_naive_reference(core_name, case):
    q, k, v, segment_ids, sink, expected = core_case_data(case)
    out = run_core(CORES[core_name], q, k, v, case[1], segment_ids, sink)
    assert out.dtype == jnp.float32 and out.shape == q.shape
    assert_close(out, expected)


@pytest.mark.parametrize("impl", ["xla", "cudnn"])
def test_attention_core_dispatcher(impl):
    case = (300, 5, True, True)
    q, k, v, segment_ids, sink, expected = core_case_data(case)
    assert_close(run_core(ATTENTION.resolve(impl), q, k, v, 5, segment_ids, sink), expected)


def test_implementation_tables_name_the_kernels():
    from model.ops.moe_dispatch import sorted_block_ffn
    from model.ops.pallas_moe import pallas_moe_ffn
    from pallas_kernels.attention import flash_attention_core

    assert ATTENTION.resolve("pallas") is flash_attention_core
    assert ATTENTION.resolve("xla") is xla_attention
    assert MOE.resolve("pallas") is pallas_moe_ffn and MOE.resolve("sorted") is sorted_block_ffn


def test_unknown_impl_raises():
    with pytest.raises(ValueError, match="attention_impl: got 'flash9'"):
        ATTENTION.resolve("flash9")
    with pytest.raises(ValueError, match="moe_impl: got 'gmm'"):
        MOE.check("gmm")


def test_segments_fully_isolate_documents():
    """A packed row equals running each document alone (outputs of the first document are also
    unaffected by changing the second document's keys/values)."""
    length, window = 300, 130
    q, k, v = make_qkv(length, seed=7)
    seg = np.stack([segments_from_boundaries(length, [140])] * BATCH)
    packed = np.asarray(run_core(xla_attention, q, k, v, window, seg, None))
    first = np.asarray(run_core(xla_attention, q[:, :140], k[:, :140], v[:, :140], window, None, None))
    second = np.asarray(run_core(xla_attention, q[:, 140:], k[:, 140:], v[:, 140:], window, None, None))
    assert_close(packed[:, :140], first)
    assert_close(packed[:, 140:], second)


def test_local_attention_accepts_any_integer_segment_ids():
    """The mask contract is `segment_ids[i] == segment_ids[j]` for any integers; relabelling the
    documents must not change the output. (Padding of the chunked path must never match.)"""
    length, window = 300, 5
    q, k, v = make_qkv(length, seed=11)
    base = make_segments(length)
    expected = reference_attention(q, k, v, window, base)
    for relabel in (-1, -2, -3, 10_000):
        seg = np.where(base == 0, relabel, base + 1000)
        out = run_core(local_attention, q, k, v, window, seg, None)
        assert_close(out, expected, err_msg=f"document 0 relabelled as {relabel}")


@pytest.mark.parametrize("window", [None, 5, 130])
@pytest.mark.parametrize("core_name", ["xla", "cudnn"])
@pytest.mark.parametrize("very_negative", [-np.inf, -1e4])
def test_minus_infinity_sink_equals_no_sink(core_name, window, very_negative):
    length = 300
    q, k, v = make_qkv(length, seed=3)
    seg = make_segments(length)
    sink = np.full(HEADS, very_negative, np.float32)
    with_sink = run_core(CORES[core_name], q, k, v, window, seg, sink)
    without = run_core(CORES[core_name], q, k, v, window, seg, None)
    assert np.all(np.isfinite(np.asarray(with_sink)))
    np.testing.assert_allclose(np.asarray(with_sink), np.asarray(without), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [None, 5, 130])
def test_jax_dot_product_attention_agrees(window):
    """External check: jax.nn.dot_product_attention with local_window_size=(W-1, 0)."""
    length = 300
    q, k, v = make_qkv(length, seed=5)
    ours = run_core(xla_attention, q, k, v, window, None, None)
    theirs = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla",
            local_window_size=None if window is None else (window - 1, 0),
        )
    )(q, k, v)
    assert_close(ours, theirs)


def _avals(jaxpr):
    """All variable avals of a jaxpr, recursing into sub-jaxprs (pjit, custom_vjp, ...)."""
    for var in list(jaxpr.invars) + list(jaxpr.constvars):
        yield var.aval
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if hasattr(sub, "eqns"):
                    yield from _avals(sub)
                elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    yield from _avals(sub.jaxpr)


def _largest_and_square(fn, length):
    q = jnp.zeros((1, length, 2, 8), jnp.float32)
    kv = jnp.zeros((1, length, 1, 8), jnp.float32)
    seg = jnp.zeros((1, length), jnp.int32)
    sink = jnp.zeros((2,), jnp.float32)
    closed = jax.make_jaxpr(lambda q, k, v, s, z: fn(q, k, v, window=128, segment_ids=s, sink=z))(
        q, kv, kv, seg, sink)
    shapes = [tuple(a.shape) for a in _avals(closed.jaxpr) if hasattr(a, "shape")]
    largest = max(int(np.prod(s)) for s in shapes)
    square = [s for s in shapes if sum(d >= length for d in s) >= 2]
    return largest, square


def test_local_attention_is_linear_in_length():
    """O(T·W) claim: with T=1024, W=128 no intermediate has two axes of size >= T, and none is
    larger than B*H*T*2C (scores of a query chunk against two key chunks)."""
    length, chunk, heads = 1024, max(128, MIN_CHUNK), 2
    largest, square = _largest_and_square(local_attention, length)
    assert not square, square
    assert largest <= heads * length * 2 * chunk, largest
    # Control: the dense path does build [T, T] arrays (its mask), so the check above can fail.
    _, dense_square = _largest_and_square(dense_attention, length)
    assert dense_square


# ---- gradients ------------------------------------------------------------------------------


def float64_value_and_grads(reference, q, k, v, sink, proj):
    """reference(q, k, v, sink) in float64 and the gradients of sum(reference * proj) w.r.t. q,
    k, v, sink by autodiff (None for a None sink)."""
    with jax.enable_x64(True):
        args = [None if a is None else jnp.asarray(np.asarray(a, np.float64))
                for a in (q, k, v, sink)]

        def loss(*args):
            out = reference(*args)
            return jnp.sum(out * proj), out

        grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*args)
        return np.asarray(out), [None if g is None else np.asarray(g) for g in grads]


def assert_gradients_close(grads, expected, tol):
    for name, got, want in zip(["q", "k", "v", "sink"], grads, expected):
        if want is not None:
            assert np.all(np.isfinite(np.asarray(got))), name
            assert_close(got, want, tol=tol, err_msg=f"d loss / d {name}")


@pytest.mark.parametrize(
    "core_name,window,with_sink,dtype",
    [("local", 5, True, F32), ("local", 130, True, F32), ("local", 130, False, F32),
     ("dense", 130, True, F32), ("dense", None, True, F32), ("dense", None, False, F32),
     ("cudnn", 130, True, F32), ("cudnn", None, True, F32), ("xla", 5, True, BF16),
     ("xla", None, True, BF16)],
)
def test_core_gradients_match_float64(core_name, window, with_sink, dtype):
    """Output and gradients against float64 autodiff of the reference. bfloat16 q/k/v (rounded
    before the reference sees them) keep their dtype; errors ~5e-3, checked at 2e-2."""
    length = 300
    q, k, v = (jnp.asarray(a, dtype) for a in make_qkv(length, seed=21))
    seg = make_segments(length)
    sink = make_sink(seed=22) if with_sink else None
    proj = np.random.default_rng(23).normal(size=q.shape)
    core = CORES[core_name]

    def loss32(q, k, v, sink):
        out = core(q, k, v, window=window, segment_ids=jnp.asarray(seg), sink=sink)
        return jnp.sum(out.astype(F32) * jnp.asarray(proj, F32)), out

    grads, out = jax.jit(jax.grad(loss32, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sink)
    assert out.dtype == dtype
    assert all(g.dtype == a.dtype for g, a in zip(grads, (q, k, v, sink)) if g is not None)
    mask = jnp.asarray(visibility_mask(length, window, seg, BATCH))
    # No sink: a -inf logit, which the reference's softmax ignores (every query sees itself).
    no_sink = jnp.full(HEADS, -jnp.inf)
    expected_out, expected = float64_value_and_grads(
        lambda q, k, v, s: jnp_reference_attention(q, k, v, no_sink if s is None else s, mask),
        q, k, v, sink, proj)
    tol = 2e-5 if dtype == F32 else 2e-2  # float32: sums of ~300 products per gradient entry
    assert_close(out, expected_out, tol=tol)
    assert_gradients_close(grads, expected, tol=tol)


def reference_masked_attention(q, k, v, mask, sink):
    """`jnp_reference_attention` for any mask [B, T, S], also one hiding every key of a row
    (whose output is then zero), and for no sink (None)."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    if sink is not None:
        sink_col = jnp.broadcast_to(sink[None, :, None, None], logits.shape[:-1] + (1,))
        logits = jnp.concatenate([logits, sink_col], axis=-1)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denominator = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights[..., :k.shape[1]] / jnp.where(denominator > 0, denominator, 1.0)
    return jnp.einsum("bhts,bshd->bthd", probs, v)


@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("scores_per_step", [1, 1 << 30], ids=["block-per-step", "one-step"])
def test_masked_attention_gradients_with_empty_rows(monkeypatch, with_sink, scores_per_step):
    """The hand-written VJP of `grouped_attention` (q, k, v and sink gradients) on an arbitrary
    mask with fully masked rows and S != T, run one block per `lax.map` step and all blocks in
    one step, against float64 autodiff of the reference above."""
    monkeypatch.setattr(attention_vjp, "_SCORES_PER_STEP", scores_per_step)
    length, keys = 9, 13
    rng = np.random.default_rng(41)
    q = rng.normal(size=(BATCH, length, HEADS, HEAD_DIM)).astype(np.float32)
    k, v = rng.normal(size=(2, BATCH, keys, KV_HEADS, HEAD_DIM)).astype(np.float32)
    mask = rng.random((BATCH, length, keys)) < 0.5
    mask[0, [2, 5]] = False  # queries that see no key at all
    mask[1, :, 4] = False  # a key nobody sees
    sink = make_sink(seed=42) if with_sink else None
    proj = rng.normal(size=q.shape)

    def loss32(q, k, v, sink):
        out = masked_attention(q, k, v, jnp.asarray(mask), sink)
        return jnp.sum(out * jnp.asarray(proj, F32)), out

    grads, out = jax.jit(jax.grad(loss32, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sink)
    expected_out, expected = float64_value_and_grads(
        lambda q, k, v, s: reference_masked_attention(q, k, v, jnp.asarray(mask), s),
        q, k, v, sink, proj)
    assert_close(out, expected_out)
    assert not np.any(np.asarray(out)[0, [2, 5]])
    assert_gradients_close(grads, expected, tol=1e-5)


def test_grouped_attention_saves_no_score_sized_residual():
    """The backward pass recomputes the probabilities: besides the boolean mask, no residual is
    as large as the [L, G*T, S] scores (a scan over layers would stack it)."""
    blocks, groups, length, keys, dim = 2, 3, 16, 32, 4
    q, kv = jnp.ones((blocks, groups * length, dim)), jnp.ones((blocks, keys, dim))
    mask = jnp.ones((blocks, length, keys), bool)
    _, backward = jax.vjp(lambda q, k, v, s: attention_vjp.grouped_attention(q, k, v, mask, s),
                          q, kv, kv, jnp.zeros((blocks, groups)))
    residuals = [r for r in jax.tree.leaves(backward) if r.dtype != jnp.bool_]
    assert residuals and max(r.size for r in residuals) < blocks * groups * length * keys


# ---- head-wise gate as a sink (report A.1, eq. 6) ---------------------------------------------


def test_eq6_gate_equals_input_dependent_sink_mass():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = rng.integers(1, 40)
        s = rng.normal(scale=3.0, size=n)
        v = rng.normal(size=(n, 5))
        g = rng.normal(scale=3.0)
        z = np.sum(np.exp(s))
        gated = sigmoid(g) * (np.exp(s) / z) @ v  # eq. 5 on eq. 4
        as_sink = (np.exp(s) / (z + np.exp(-g) * z)) @ v  # eq. 6
        np.testing.assert_allclose(gated, as_sink, rtol=1e-12, atol=1e-12)


def test_eq6_through_the_sink_kernel():
    """Eq. 6 with the code's sink path: for a chosen query i, setting the per-head sink logit to
    log(exp(-g) Z_i) = lse_i - g makes the sink-attention output equal sigmoid(g) * plain output."""
    length, window, query = 300, 130, 277
    q, k, v = make_qkv(length, seed=31)
    g = np.random.default_rng(32).normal(scale=2.0, size=HEADS)
    kv_rep = np.repeat(k.astype(np.float64), GROUPS, axis=2)
    keys = visible_keys(query, length, window, None)
    lse = np.log(np.sum(np.exp(
        np.einsum("bhd,bjhd->bhj", q[:, query].astype(np.float64), kv_rep[:, keys]) / np.sqrt(HEAD_DIM)
    ), axis=-1))  # [B, H]
    expected = sigmoid(g)[None, :, None] * reference_attention(q, k, v, window)[:, query]
    for core_name in ("xla", "cudnn"):
        for b in range(BATCH):
            sink = (lse[b] - g).astype(np.float32)
            out = run_core(CORES[core_name], q[b:b + 1], k[b:b + 1], v[b:b + 1], window, None, sink)
            assert_close(np.asarray(out)[0, query], expected[b], err_msg=core_name)
