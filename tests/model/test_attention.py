"""Attention cores, the `Attention` module and the head-wise gate against float64 references.

Every expected value here is computed independently of `model/`: numpy float64 with an explicit
per-query list of visible keys (query i sees key j iff j <= i, i - j < W and same segment),
KV heads repeated explicitly for GQA (query head h uses KV head h // G), and the sink written
as one extra softmax logit whose value vector is zero.

Tolerances: float32 kernels vs float64 references agree to ~1e-6 relative; tests use 1e-5
(relative to the reference's magnitude) unless a comment says otherwise.
"""

import functools
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from flax.linen import meta

from model.layers.attention import Attention
from model.ops.tables import ATTENTION, MOE
from model.ops.attention_cores import (
    MIN_CHUNK,
    cudnn_attention,
    dense_attention,
    local_attention,
    xla_attention,
)
from model.config import AttentionTypeConfig, ModelConfig, MTPConfig, RopeScaling, load_config
from model.lm import CausalLM

REPO = pathlib.Path(__file__).resolve().parents[2]
TOL = 1e-5


def assert_close(actual, expected, tol=TOL, err_msg=""):
    """|actual - expected| <= tol * (|expected| + max|expected|): relative to the magnitude."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=err_msg)


# ---- independent float64 references ----------------------------------------------------------


def visible_keys(i, length, window, segment_row):
    """Key indices query i may attend to, written straight from the spec."""
    return [
        j for j in range(length)
        if j <= i
        and (window is None or i - window < j)
        and (segment_row is None or segment_row[i] == segment_row[j])
    ]


def reference_attention(q, k, v, window=None, segment_ids=None, sink=None):
    """q [B,T,H,D], k/v [B,T,K,D] -> [B,T,H,D] float64; loops over batch and query."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    batch, length, heads, dim = q.shape
    groups = heads // k.shape[2]
    k = np.repeat(k, groups, axis=2)  # head h -> KV head h // groups
    v = np.repeat(v, groups, axis=2)
    out = np.zeros_like(q)
    for b in range(batch):
        seg_row = None if segment_ids is None else np.asarray(segment_ids)[b]
        for i in range(length):
            keys = visible_keys(i, length, window, seg_row)
            logits = np.einsum("hd,jhd->hj", q[b, i], k[b, keys]) / np.sqrt(dim)
            if sink is not None:  # one extra logit per head with a zero value vector
                logits = np.concatenate([logits, np.asarray(sink, np.float64)[:, None]], axis=1)
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            out[b, i] = np.einsum("hj,jhd->hd", probs[:, : len(keys)], v[b, keys])
    return out


def visibility_mask(length, window, segment_ids, batch):
    """[B, T, T] bool, built entry by entry from `visible_keys`."""
    mask = np.zeros((batch, length, length), bool)
    for b in range(batch):
        seg_row = None if segment_ids is None else np.asarray(segment_ids)[b]
        for i in range(length):
            mask[b, i, visible_keys(i, length, window, seg_row)] = True
    return mask


def jnp_reference_attention(q, k, v, sink, mask):
    """Differentiable masked-softmax attention (used in float64 under jax.enable_x64)."""
    heads, dim = q.shape[2], q.shape[3]
    groups = heads // k.shape[2]
    k = jnp.repeat(k, groups, axis=2)
    v = jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(dim)
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    sink_col = jnp.broadcast_to(sink[None, :, None, None], logits.shape[:-1] + (1,))
    logits = jnp.concatenate([logits, sink_col], axis=-1)
    e = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    return jnp.einsum("bhts,bshd->bthd", probs[..., :-1], v)


def segments_from_boundaries(length, boundaries):
    """Segment ids 0, 1, 2, ... starting a new document at each boundary index."""
    seg = np.zeros(length, np.int32)
    for start in boundaries:
        seg[start:] += 1
    return seg


def positions_restarting(segment_row, offset=0):
    """Position within the document (restarts at each segment change), plus a constant offset."""
    pos = np.zeros(len(segment_row), np.int32)
    for i in range(1, len(segment_row)):
        pos[i] = 0 if segment_row[i] != segment_row[i - 1] else pos[i - 1] + 1
    return pos + offset


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# ---- attention cores ------------------------------------------------------------------------

BATCH, KV_HEADS, GROUPS, HEAD_DIM = 2, 2, 3, 8
HEADS = KV_HEADS * GROUPS


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
    from pallas_kernels.flash_attention import flash_attention_core

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
    # Control: the dense path does build [T, T] scores, so the check above can fail.
    _, dense_square = _largest_and_square(dense_attention, length)
    assert dense_square


# ---- gradients ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "core_name,window",
    [("local", 5), ("local", 130), ("dense", 130), ("dense", None), ("cudnn", 130), ("cudnn", None)],
)
def test_core_gradients_match_float64(core_name, window):
    length = 300
    q, k, v = make_qkv(length, seed=21)
    seg = make_segments(length)
    sink = make_sink(seed=22)
    proj = np.random.default_rng(23).normal(size=q.shape)
    core = CORES[core_name]

    def loss32(q, k, v, sink):
        out = core(q, k, v, window=window, segment_ids=jnp.asarray(seg), sink=sink)
        return jnp.sum(out * jnp.asarray(proj, jnp.float32))

    grads = jax.jit(jax.grad(loss32, argnums=(0, 1, 2, 3)))(q, k, v, sink)

    mask = visibility_mask(length, window, seg, BATCH)
    with jax.enable_x64(True):
        def loss64(q, k, v, sink):
            return jnp.sum(jnp_reference_attention(q, k, v, sink, jnp.asarray(mask)) * proj)

        f64 = lambda a: jnp.asarray(a, jnp.float64)
        expected = jax.grad(loss64, argnums=(0, 1, 2, 3))(f64(q), f64(k), f64(v), f64(sink))
        expected = [np.asarray(g) for g in expected]
    for name, got, want in zip("q k v sink".split(), grads, expected):
        assert got.dtype == jnp.float32
        # Sums of ~300 float32 products per gradient entry: 2e-5 relative to the max magnitude.
        assert_close(got, want, tol=2e-5, err_msg=f"d loss / d {name}")


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


# ---- the Attention module -------------------------------------------------------------------

D_MODEL, MOD_HEAD_DIM, MOD_KV, MOD_WINDOW = 32, 16, 2, 7
# (num heads, rope theta, rotary dims) written out here rather than read from the config.
TYPE_FACTS = {"F": (4, 500.0, 8), "S": (6, 10_000.0, 16)}
LLAMA3 = RopeScaling(type="llama3", factor=8.0, original_max_len=64, low_freq_factor=1.0,
                     high_freq_factor=4.0)


def module_config(gate="headwise", impl="xla", qk_norm=True, full_scaling=RopeScaling()):
    return ModelConfig(
        vocab_size=64, d_model=D_MODEL, num_layers=2, layout="FS", window=MOD_WINDOW,
        head_dim=MOD_HEAD_DIM, num_kv_heads=MOD_KV,
        full_attention=AttentionTypeConfig(num_heads=4, rope_theta=500.0, partial_rotary_factor=0.5,
                                           rope_scaling=full_scaling),
        swa_attention=AttentionTypeConfig(num_heads=6, rope_theta=10_000.0, partial_rotary_factor=1.0),
        gate=gate, qk_norm=qk_norm, num_dense_layers=2, dense_hidden=32, mtp=MTPConfig(num_heads=0),
        attention_impl=impl,
    )


def module_inputs(length=150, seed=0):
    """x [2, T, D]; row 0 packs three documents (a boundary crosses the 128-chunk edge), row 1 is
    one document whose positions start at 5."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, length, D_MODEL)).astype(np.float32)
    seg = np.stack([segments_from_boundaries(length, [60, 130]), np.zeros(length, np.int32)])
    pos = np.stack([positions_restarting(seg[0]), positions_restarting(seg[1], offset=5)])
    return x, pos.astype(np.int32), seg


def random_module_params(cfg, attention_type, x, pos, seg, seed=0):
    """Initialises the module, then replaces every param by random values of a useful scale
    (norm weights and sinks are 0 at init, which would hide their use)."""
    variables = jax.eval_shape(Attention(cfg, attention_type).init, jax.random.key(0), x, pos, seg)
    flat = traverse_util.flatten_dict(meta.unbox(variables["params"]), sep="/")
    rng = np.random.default_rng(seed)
    new = {}
    for name, value in sorted(flat.items()):
        if name.endswith("kernel"):
            fan_in = value.shape[0] if name.split("/")[0] != "o_proj" else value.shape[0] * value.shape[1]
            new[name] = rng.normal(scale=fan_in**-0.5, size=value.shape)
        else:  # q_norm/k_norm weights, sink
            new[name] = rng.normal(scale=0.5, size=value.shape)
        new[name] = jnp.asarray(new[name], jnp.float32)
    return traverse_util.unflatten_dict(new, sep="/")


def reference_inv_freq(rotary_dims, theta, scaling):
    inv_freq = np.array([theta ** (-2.0 * i / rotary_dims) for i in range(rotary_dims // 2)])
    if scaling.type == "none":
        return inv_freq
    assert scaling.type == "llama3"
    out = []
    for f in inv_freq:
        wavelength = 2 * np.pi / f
        if wavelength < scaling.original_max_len / scaling.high_freq_factor:
            out.append(f)
        elif wavelength > scaling.original_max_len / scaling.low_freq_factor:
            out.append(f / scaling.factor)
        else:
            smooth = (scaling.original_max_len / wavelength - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor)
            out.append((1 - smooth) * f / scaling.factor + smooth * f)
    return np.array(out)


def reference_rope(x, pos, rotary_dims, inv_freq):
    """Rotate-half on the first rotary_dims dims: pairs (i, i + rotary_dims/2)."""
    x = x.copy()
    half = rotary_dims // 2
    angle = pos[:, :, None, None] * inv_freq[None, None, None, :]
    a, b = x[..., :half].copy(), x[..., half:rotary_dims].copy()
    x[..., :half] = a * np.cos(angle) - b * np.sin(angle)
    x[..., half:rotary_dims] = b * np.cos(angle) + a * np.sin(angle)
    return x


def reference_rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * (1.0 + w)


def reference_module(params, attention_type, x, pos, seg, gate, qk_norm=True,
                     scaling=RopeScaling()):
    p = {k: np.asarray(v, np.float64) for k, v in traverse_util.flatten_dict(params, sep="/").items()}
    heads, theta, rotary_dims = TYPE_FACTS[attention_type]
    x = x.astype(np.float64)
    q = np.einsum("btd,dhk->bthk", x, p["q_proj/kernel"])
    k = np.einsum("btd,dhk->bthk", x, p["k_proj/kernel"])
    v = np.einsum("btd,dhk->bthk", x, p["v_proj/kernel"])
    assert q.shape[2] == heads and k.shape[2] == MOD_KV
    if qk_norm:
        q = reference_rms(q, p["q_norm/weight"])
        k = reference_rms(k, p["k_norm/weight"])
    inv_freq = reference_inv_freq(rotary_dims, theta, scaling)
    q = reference_rope(q, pos, rotary_dims, inv_freq)
    k = reference_rope(k, pos, rotary_dims, inv_freq)
    window = MOD_WINDOW if attention_type == "S" else None
    y = reference_attention(q, k, v, window, seg, p.get("sink") if gate == "sink" else None)
    if gate == "headwise":
        y = y * sigmoid(np.einsum("btd,dh->bth", x, p["g_proj/kernel"]))[..., None]
    return np.einsum("bthk,hkd->btd", y, p["o_proj/kernel"])


MODULE_CASES = [
    pytest.param(t, g, True, RopeScaling(), id=f"{t}-{g}") for t in "FS" for g in ("headwise", "sink", "none")
] + [
    pytest.param("F", "headwise", True, LLAMA3, id="F-headwise-llama3"),
    pytest.param("S", "none", False, RopeScaling(), id="S-none-noqknorm"),
]


@pytest.mark.parametrize("attention_type,gate,qk_norm,scaling", MODULE_CASES)
def test_attention_module_matches_numpy(attention_type, gate, qk_norm, scaling):
    cfg = module_config(gate=gate, qk_norm=qk_norm, full_scaling=scaling)
    x, pos, seg = module_inputs()
    params = random_module_params(cfg, attention_type, x, pos, seg)
    expected_names = {"q_proj", "k_proj", "v_proj", "o_proj"} | (
        {"q_norm", "k_norm"} if qk_norm else set()) | (
        {"g_proj"} if gate == "headwise" else set()) | ({"sink"} if gate == "sink" else set())
    assert set(params) == expected_names
    out, aux = jax.jit(Attention(cfg, attention_type).apply)({"params": params}, x, pos, seg)
    expected = reference_module(params, attention_type, x, pos, seg, gate, qk_norm, scaling)
    assert out.shape == x.shape and out.dtype == jnp.float32
    assert_close(out, expected)
    if gate == "headwise":
        g = sigmoid(np.einsum("btd,dh->bth", x.astype(np.float64),
                              np.asarray(params["g_proj"]["kernel"], np.float64)))
        assert_close(aux["gate_mean"], g.mean(axis=(0, 1)))


def _o_proj_inputs(cfg, attention_type, params, x, pos, seg):
    """Runs the module and returns the array fed to o_proj (the per-head outputs)."""

    def run(params, x):
        seen = []

        def record(next_fun, args, kwargs, context):
            if context.module.name == "o_proj" and context.method_name == "__call__":
                seen.append(args[0])
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(record):
            Attention(cfg, attention_type).apply({"params": params}, x, pos, seg)
        assert len(seen) == 1
        return seen[0]

    return np.asarray(jax.jit(run)(params, x), np.float64)


@pytest.mark.parametrize("attention_type", ["F", "S"])
def test_headwise_gate_multiplies_each_head_before_o_proj(attention_type):
    cfg = module_config(gate="headwise")
    x, pos, seg = module_inputs()
    params = random_module_params(cfg, attention_type, x, pos, seg)
    gated = _o_proj_inputs(cfg, attention_type, params, x, pos, seg)
    ungated_params = {k: v for k, v in params.items() if k != "g_proj"}
    plain = _o_proj_inputs(module_config(gate="none"), attention_type, ungated_params, x, pos, seg)
    gate = sigmoid(np.einsum("btd,dh->bth", x.astype(np.float64),
                             np.asarray(params["g_proj"]["kernel"], np.float64)))
    assert_close(gated, plain * gate[..., None])


# ---- implementation switch -------------------------------------------------------------------


@pytest.mark.parametrize("attention_type,gate", [("F", "sink"), ("S", "sink"), ("S", "headwise")])
def test_cudnn_impl_matches_xla_outputs_and_gradients(attention_type, gate):
    x, pos, seg = module_inputs()
    params = random_module_params(module_config(gate=gate), attention_type, x, pos, seg)
    proj = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)
    results = {}
    for impl in ("xla", "cudnn"):
        module = Attention(module_config(gate=gate, impl=impl), attention_type)

        def loss(params, x):
            out, _ = module.apply({"params": params}, x, pos, seg)
            return jnp.sum(out * proj), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
        results[impl] = (out, grads)
    assert_close(results["cudnn"][0], results["xla"][0])
    flat_xla = traverse_util.flatten_dict(results["xla"][1][0], sep="/")
    flat_cudnn = traverse_util.flatten_dict(results["cudnn"][1][0], sep="/")
    assert flat_xla.keys() == flat_cudnn.keys()
    if gate == "sink":
        assert "sink" in flat_xla and np.max(np.abs(flat_xla["sink"])) > 1e-3
    for name in flat_xla:
        # Gradients of float32 kernels computed in different orders: 2e-5 of the max magnitude.
        assert_close(flat_cudnn[name], flat_xla[name], tol=2e-5, err_msg=name)
    assert_close(results["cudnn"][1][1], results["xla"][1][1], tol=2e-5, err_msg="d loss / d x")


def test_pallas_impl_module_matches_xla():
    """The Attention module with the Pallas core (interpret mode on CPU) equals the XLA core."""
    x, pos, seg = module_inputs(length=16)
    outputs = {}
    for impl in ("xla", "pallas"):
        module = Attention(module_config(gate="sink", impl=impl), "S")
        variables = module.init(jax.random.key(0), x, pos, seg)
        outputs[impl] = module.apply(variables, x, pos, seg)[0]
    assert_close(outputs["pallas"], outputs["xla"], tol=1e-5)


# ---- segment ids at the model level ----------------------------------------------------------


def test_causal_lm_packed_documents_match_separate_runs():
    """CausalLM derives per-document positions from segment_ids; MoE routing is per token, so
    each document of a packed row gives the same logits as that document alone."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", overrides=[
        "num_layers=3", "layout=FSS", "num_dense_layers=1", "swiglu_limits=0",
        "swiglu_limits_shared=0", "mtp.num_heads=0"])
    doc_len = 75  # packed T=150 > 128: the SWA layers (window 32) take the chunked path
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, size=(1, 2 * doc_len)).astype(np.int32)
    seg = np.repeat(np.arange(2, dtype=np.int32), doc_len)[None]
    lm = CausalLM(cfg)
    variables = jax.jit(lm.init)(jax.random.key(0), tokens)
    # Segment ids are always passed as an array so one trace per length serves every call.
    apply = jax.jit(lambda t, s: lm.apply(variables, t, segment_ids=s).logits)
    one_doc = np.zeros((1, doc_len), np.int32)
    packed = np.asarray(apply(tokens, seg))
    alone_a = np.asarray(apply(tokens[:, :doc_len], one_doc))
    alone_b = np.asarray(apply(tokens[:, doc_len:], one_doc))
    assert_close(packed[:, :doc_len], alone_a)
    assert_close(packed[:, doc_len:], alone_b)
    # Control: as one document the second half sees the first, and the comparison notices.
    unpacked = np.asarray(apply(tokens, np.zeros_like(seg)))
    assert np.max(np.abs(unpacked[:, doc_len:] - alone_b)) > 100 * TOL * np.max(np.abs(alone_b))


def test_causal_lm_feeds_per_document_positions_to_every_attention_layer():
    """RoPE scores depend only on position differences, so the packed-row test above cannot see
    whether positions restart per document; check what each Attention layer receives instead."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", overrides=[
        "num_layers=2", "layout=FS", "num_dense_layers=2", "swiglu_limits=0",
        "swiglu_limits_shared=0", "mtp.num_heads=0", "scan_layers=false"])
    seg = np.array([[4, 4, 4, 1, 1, 1, 1, 9, 9, 9, 9, 9],
                    [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3]], np.int32)
    tokens = np.arange(seg.size, dtype=np.int32).reshape(seg.shape) % cfg.vocab_size
    lm = CausalLM(cfg)
    variables = jax.eval_shape(lm.init, jax.random.key(0), tokens)
    variables = jax.tree.map(lambda s: jnp.full(s.shape, 0.01, s.dtype), meta.unbox(variables))

    def attention_inputs(tokens, segment_ids, positions):
        seen = []

        def record(next_fun, args, kwargs, context):
            if isinstance(context.module, Attention) and context.method_name == "__call__":
                seen.append(args[1:3])  # (positions, segment_ids)
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(record):
            lm.apply(variables, tokens, segment_ids=segment_ids, positions=positions)
        return seen

    expected = np.stack([positions_restarting(row) for row in seg])
    seen = jax.jit(attention_inputs)(tokens, seg, None)
    assert len(seen) == cfg.num_layers
    for positions, segment_ids in seen:
        np.testing.assert_array_equal(np.asarray(positions), expected)
        np.testing.assert_array_equal(np.asarray(segment_ids), seg)
    # No segment ids: 0..T-1 everywhere; explicit positions are used as given.
    for positions, _ in jax.jit(lambda t: attention_inputs(t, None, None))(tokens):
        np.testing.assert_array_equal(np.asarray(positions), np.broadcast_to(np.arange(12), seg.shape))
    given = (np.arange(seg.size, dtype=np.int32).reshape(seg.shape) * 3) % 17
    for positions, _ in jax.jit(attention_inputs)(tokens, seg, given):
        np.testing.assert_array_equal(np.asarray(positions), given)
