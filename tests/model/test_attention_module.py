"""The `Attention` module (projections, QK norm, RoPE with and without llama3 scaling, the
head-wise gate, the sink) against a numpy float64 reference, its implementation switch (cudnn,
pallas against xla), and segment ids at the model level (packed documents, per-document
positions). References: tests/attention_references.py and the RoPE/RMSNorm references below,
all independent of `model/`.

Tolerances: float32 against float64 references agree to ~1e-6 relative; tests use 1e-5
(relative to the reference's magnitude) unless a comment says otherwise.
"""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_references import (
    TOL,
    assert_close,
    positions_restarting,
    reference_attention,
    segments_from_boundaries,
    sigmoid,
)
from flax import traverse_util
from flax.linen import meta

from model.config import AttentionTypeConfig, ModelConfig, MTPConfig, RopeScaling, load_config
from model.layers.attention import Attention
from model.lm import CausalLM

REPO = pathlib.Path(__file__).resolve().parents[2]


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


@pytest.mark.slow
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


@pytest.mark.slow
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
