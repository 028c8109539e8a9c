"""MiMo-V2-Flash's attention geometry: per-type KV heads and Q/K head dims, values
narrower than keys (Dv < D), the sink on one layer type only, `value_scale`, partial RoPE on
the leading int(0.334 * 48) = 16 dims, the window convention (query i sees keys i - W < j <= i,
transformers' `kv_idx > q_idx - sliding_window`) and packed documents, through the `Attention`
layer and the attention cores; `with_values_padded` lets the cudnn core (XLA fallback on CPU)
and the Pallas core (interpret mode) take Dv < D with the xla core's outputs and gradients.

Expected values: numpy float64 with an explicit per-query list of visible keys
(tests/attention_references.py) and float64 autodiff of a masked-softmax reference; every
geometry fact (heads, dims, rotary dims, gate, window) is written out here, not read from the
config. Tolerances as tests/model/test_attention_cores.py: 1e-5 relative to the reference's
magnitude for outputs, 2e-5 for gradients (float32 sums of ~300 products).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_references import (
    assert_close,
    jnp_reference_attention,
    positions_restarting,
    reference_attention,
    segments_from_boundaries,
    sigmoid,
    visibility_mask,
)
from flax import traverse_util
from flax.linen import meta

from model.config import AttentionTypeConfig, ModelConfig, MTPConfig
from model.layers.attention import Attention
from model.ops.attention_cores import with_values_padded, xla_attention
from model.ops.cudnn_attention import cudnn_attention
from pallas_kernels.flash_attention import flash_attention

D_MODEL, WINDOW = 32, 7


def mimo_config(impl="xla"):
    """tiny_mimo.yaml's attention: 1 KV head full / 2 SWA, Q/K 48 dims, V 32, sink on S only."""
    return ModelConfig(
        vocab_size=64, d_model=D_MODEL, num_layers=2, layout="FS", window=WINDOW, head_dim=48,
        num_kv_heads=1, v_head_dim=32, gate="none", qk_norm=False, value_scale=0.707,
        full_attention=AttentionTypeConfig(num_heads=4, rope_theta=640_000.0,
                                           partial_rotary_factor=0.334),
        swa_attention=AttentionTypeConfig(num_heads=4, num_kv_heads=2, rope_theta=10_000.0,
                                          partial_rotary_factor=0.334, gate="sink"),
        num_dense_layers=2, dense_hidden=32, mtp=MTPConfig(num_heads=0), attention_impl=impl)


def mixed_config(impl="xla"):
    """Step 3.5's head-wise gate and QK norm on full layers (Dv = D = 48), the sink and a
    per-type geometry on SWA layers (6 heads over 3 KV heads of Q/K 32 / V 16 dims)."""
    return ModelConfig(
        vocab_size=64, d_model=D_MODEL, num_layers=2, layout="FS", window=WINDOW, head_dim=48,
        num_kv_heads=2, gate="headwise", qk_norm=True,
        full_attention=AttentionTypeConfig(num_heads=4, rope_theta=500.0,
                                           partial_rotary_factor=0.5),
        swa_attention=AttentionTypeConfig(num_heads=6, num_kv_heads=3, head_dim=32, v_head_dim=16,
                                          rope_theta=10_000.0, partial_rotary_factor=0.5,
                                          gate="sink"),
        num_dense_layers=2, dense_hidden=32, mtp=MTPConfig(num_heads=0), attention_impl=impl)


CONFIGS = {"mimo": mimo_config, "mixed": mixed_config}
# (heads, KV heads, Q/K dim, V dim, rotary dims, theta, gate, value scale, qk norm, window)
FACTS = {
    ("mimo", "F"): (4, 1, 48, 32, 16, 640_000.0, "none", 0.707, False, None),
    ("mimo", "S"): (4, 2, 48, 32, 16, 10_000.0, "sink", 0.707, False, WINDOW),
    ("mixed", "F"): (4, 2, 48, 48, 24, 500.0, "headwise", 1.0, True, None),
    ("mixed", "S"): (6, 3, 32, 16, 16, 10_000.0, "sink", 1.0, True, WINDOW),
}


def module_inputs(length=150, seed=0):
    """x [2, T, D]; row 0 packs three documents (one boundary crosses the 128-row chunk edge of
    the local path), row 1 is one document whose positions start at 5."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, length, D_MODEL)).astype(np.float32)
    seg = np.stack([segments_from_boundaries(length, [60, 130]), np.zeros(length, np.int32)])
    pos = np.stack([positions_restarting(seg[0]), positions_restarting(seg[1], offset=5)])
    return x, pos.astype(np.int32), seg


def random_params(cfg, attention_type, x, pos, seg, seed=0):
    """Every param random at a useful scale (norm weights and sinks start at 0)."""
    shapes = jax.eval_shape(Attention(cfg, attention_type).init, jax.random.key(0), x, pos, seg)
    flat = traverse_util.flatten_dict(meta.unbox(shapes["params"]), sep="/")
    rng = np.random.default_rng(seed)
    new = {}
    for name, value in sorted(flat.items()):
        fan_in = int(np.prod(value.shape[:2 if name.startswith("o_proj") else 1]))
        scale = fan_in**-0.5 if name.endswith("kernel") else 0.5
        new[name] = jnp.asarray(rng.normal(scale=scale, size=value.shape), jnp.float32)
    return traverse_util.unflatten_dict(new, sep="/")


def reference_rope(x, pos, rotary_dims, theta):
    """Rotate-half on the leading rotary_dims dims: pair (i, i + rotary_dims/2) turns by
    pos * theta^(-2i / rotary_dims); the other dims pass through."""
    out = x.copy()
    half = rotary_dims // 2
    for i in range(half):
        angle = pos[:, :, None] * theta ** (-2.0 * i / rotary_dims)
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * np.cos(angle) - b * np.sin(angle)
        out[..., i + half] = b * np.cos(angle) + a * np.sin(angle)
    return out


def reference_rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * (1.0 + w)


def reference_module(params, facts, x, pos, seg):
    heads, kv_heads, qk_dim, v_dim, rotary, theta, gate, v_scale, qk_norm, window = facts
    flat = traverse_util.flatten_dict(params, sep="/")
    p = {name: np.asarray(value, np.float64) for name, value in flat.items()}
    x = x.astype(np.float64)
    q = np.einsum("btd,dhk->bthk", x, p["q_proj/kernel"])
    k = np.einsum("btd,dhk->bthk", x, p["k_proj/kernel"])
    v = np.einsum("btd,dhk->bthk", x, p["v_proj/kernel"]) * v_scale
    assert q.shape[2:] == (heads, qk_dim) and k.shape[2:] == (kv_heads, qk_dim)
    assert v.shape[2:] == (kv_heads, v_dim)
    if qk_norm:
        q, k = reference_rms(q, p["q_norm/weight"]), reference_rms(k, p["k_norm/weight"])
    q, k = reference_rope(q, pos, rotary, theta), reference_rope(k, pos, rotary, theta)
    y = reference_attention(q, k, v, window, seg, p["sink"] if gate == "sink" else None)
    if gate == "headwise":
        y = y * sigmoid(np.einsum("btd,dh->bth", x, p["g_proj/kernel"]))[..., None]
    return np.einsum("bthk,hkd->btd", y, p["o_proj/kernel"])


@pytest.mark.parametrize("name,attention_type", list(FACTS))
def test_attention_module_matches_float64_reference(name, attention_type):
    cfg = CONFIGS[name]()
    facts = FACTS[name, attention_type]
    x, pos, seg = module_inputs()
    params = random_params(cfg, attention_type, x, pos, seg)
    gate, qk_norm = facts[6], facts[8]
    assert set(params) == {"q_proj", "k_proj", "v_proj", "o_proj"} | (
        {"q_norm", "k_norm"} if qk_norm else set()) | (
        {"g_proj"} if gate == "headwise" else set()) | ({"sink"} if gate == "sink" else set())
    out, aux = jax.jit(Attention(cfg, attention_type).apply)({"params": params}, x, pos, seg)
    assert out.shape == x.shape and out.dtype == jnp.float32
    assert ("gate_mean" in aux) == (gate == "headwise")
    assert_close(out, reference_module(params, facts, x, pos, seg))


def test_value_scale_and_partial_rope_are_visible():
    """Controls for the test above: a reference without the value scale, or rotating all 48
    dims, or a window one wider, is far from the layer's output."""
    cfg, facts = mimo_config(), FACTS["mimo", "S"]
    x, pos, seg = module_inputs()
    params = random_params(cfg, "S", x, pos, seg)
    out = np.asarray(jax.jit(Attention(cfg, "S").apply)({"params": params}, x, pos, seg)[0])
    for i, wrong in ((7, 1.0), (4, 48), (9, WINDOW + 1)):
        changed = list(facts)
        changed[i] = wrong
        expected = reference_module(params, tuple(changed), x, pos, seg)
        assert np.max(np.abs(out - expected)) > 1e-3 * np.max(np.abs(expected)), (i, wrong)


# ---- the cores with values narrower than keys ------------------------------------------------

BATCH, KV_HEADS, GROUPS, HEAD_DIM, V_HEAD_DIM = 2, 2, 3, 12, 8
HEADS = KV_HEADS * GROUPS


@functools.lru_cache(maxsize=None)
def core_inputs(length, seed):
    """q [B,T,H,12], k [B,T,K,12], v [B,T,K,8], segments (boundaries on and next to the 128
    edge, a one-token document), a sink of mixed signs and a cotangent [B,T,H,8]."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(BATCH, length, HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.normal(size=(BATCH, length, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.normal(size=(BATCH, length, KV_HEADS, V_HEAD_DIM)).astype(np.float32)
    seg = np.stack([
        segments_from_boundaries(length, [b for b in (3, 20, 127, 128, 200) if b < length]),
        segments_from_boundaries(length, [b for b in (30, 31, 170) if b < length])])
    sink = rng.uniform(-2.0, 2.5, size=HEADS).astype(np.float32)
    cotangent = rng.normal(size=(BATCH, length, HEADS, V_HEAD_DIM)).astype(np.float32)
    return q, k, v, seg, sink, cotangent


@pytest.mark.parametrize("length,window,with_seg,with_sink", [
    (37, None, True, True), (300, None, True, True), (300, 5, True, True),
    (300, 130, True, False), (256, 128, False, True), (300, 1, True, True)])
def test_xla_core_values_narrower_than_keys(length, window, with_seg, with_sink):
    q, k, v, seg, sink, _ = core_inputs(length, length + (window or 0))
    seg, sink = (seg if with_seg else None), (sink if with_sink else None)
    out = jax.jit(xla_attention, static_argnames="window")(
        q, k, v, window=window, segment_ids=seg, sink=sink)
    assert out.shape == (BATCH, length, HEADS, V_HEAD_DIM) and out.dtype == jnp.float32
    assert_close(out, reference_attention(q, k, v, window, seg, sink))


def value_and_grads(core, window, inputs):
    """(output, (dq, dk, dv, dsink)) of <core(q, k, v), cotangent> in float32."""
    q, k, v, seg, sink, cotangent = inputs

    def loss(q, k, v, sink):
        out = core(q, k, v, window=window, segment_ids=jnp.asarray(seg), sink=sink)
        return jnp.sum(out * cotangent), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sink)
    return np.asarray(out), [np.asarray(g) for g in grads]


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 5, 130])
def test_xla_core_gradients_with_narrow_values_match_float64(window):
    inputs = core_inputs(300, 7)
    q, k, v, seg, sink, cotangent = inputs
    out, grads = value_and_grads(xla_attention, window, inputs)
    mask = jnp.asarray(visibility_mask(300, window, seg, BATCH))
    with jax.enable_x64(True):
        def loss(*args):
            ref = jnp_reference_attention(*args[:3], args[3], mask)
            return jnp.sum(ref * jnp.asarray(cotangent, jnp.float64)), ref

        args = [jnp.asarray(a, jnp.float64) for a in (q, k, v, sink)]
        expected, ref_out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*args)
    assert_close(out, np.asarray(ref_out))
    for name, got, want in zip(("q", "k", "v", "sink"), grads, expected):
        assert got.shape == np.shape(want)
        assert_close(got, np.asarray(want), tol=2e-5, err_msg=f"d loss / d {name}")


def pallas_interpret(q, k, v, *, window, segment_ids, sink):
    return flash_attention(q, k, v, window=window, segment_ids=segment_ids, sink=sink,
                           block_q=16, block_k=16, interpret=True)


@pytest.mark.parametrize("core_name,length,window", [
    ("cudnn", 300, 130), ("cudnn", 300, None), ("pallas", 40, 7), ("pallas", 40, None)])
@pytest.mark.slow
def test_padded_values_give_the_xla_core(core_name, length, window):
    """Kernels that need one head dim get zero-padded values (`with_values_padded`; the cudnn
    core pads them itself, the raw Triton kernel refuses Dv != D): the xla core's output and
    gradients (q, k, v, sink), and the output keeps Dv columns."""
    inputs = core_inputs(length, 11)
    if core_name == "cudnn":
        core = cudnn_attention
    else:
        with pytest.raises(ValueError, match="k/v"):  # unpadded: Dv != D refused
            jax.eval_shape(functools.partial(pallas_interpret, window=window, segment_ids=None,
                                             sink=None), *inputs[:3])
        core = with_values_padded(pallas_interpret)
    out, grads = value_and_grads(core, window, inputs)
    expected_out, expected = value_and_grads(xla_attention, window, inputs)
    assert out.shape == (BATCH, length, HEADS, V_HEAD_DIM)
    assert_close(out, expected_out)
    for name, got, want in zip(("q", "k", "v", "sink"), grads, expected):
        assert_close(got, want, tol=2e-5, err_msg=f"d loss / d {name}")


@pytest.mark.parametrize("impl,length", [("cudnn", 150), ("pallas", 24)])
def test_attention_module_other_impls_equal_xla(impl, length):
    """The cudnn and pallas cores take values narrower than the keys (MiMo SWA type: Dv 32 <
    D 48, sink, 2 KV heads): output and parameter gradients equal the xla core's."""
    x, pos, seg = module_inputs(length)
    params = random_params(mimo_config(), "S", x, pos, seg)
    proj = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)
    results = {}
    for name in ("xla", impl):
        module = Attention(mimo_config(impl=name), "S")

        def loss(params):
            out, _ = module.apply({"params": params}, x, pos, seg)
            return jnp.sum(out * proj), out

        results[name] = jax.jit(jax.grad(loss, has_aux=True))(params)
    assert_close(results[impl][1], results["xla"][1])
    flat = {n: traverse_util.flatten_dict(results[n][0], sep="/") for n in ("xla", impl)}
    assert flat["xla"].keys() == flat[impl].keys() and "sink" in flat["xla"]
    for name in flat["xla"]:
        assert_close(flat[impl][name], flat["xla"][name], tol=2e-5, err_msg=name)
