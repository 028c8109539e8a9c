"""mHC (report eqs. 1-8): Sinkhorn, the sublayer mappings, the collapse / write-back and the
head collapse against float64 numpy loop references, parity with transformers'
DeepseekV4HyperConnection / DeepseekV4HyperHead, and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.layers.hyper_connections import (
    HyperConnection,
    HyperHead,
    expand_embeddings,
    expand_streams,
    sinkhorn,
)

B, T, N, D = 2, 3, 4, 8
ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-6


# ---- float64 loop references -------------------------------------------------------------------


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_sinkhorn(logits, iters, eps):
    """One [n, n] matrix (source j, target k), eq. 8 as upstream orders it, with loops."""
    n = logits.shape[0]
    m = np.exp(logits.astype(np.float64))
    for j in range(n):  # exp, then normalise over k (eq. 8's first T_c), then + eps
        m[j] = m[j] / sum(m[j, k] for k in range(n)) + eps

    def over_sources(m):
        out = m.copy()
        for k in range(n):
            total = sum(m[j, k] for j in range(n)) + eps
            for j in range(n):
                out[j, k] = m[j, k] / total
        return out

    def over_targets(m):
        out = m.copy()
        for j in range(n):
            total = sum(m[j, k] for k in range(n)) + eps
            for k in range(n):
                out[j, k] = m[j, k] / total
        return out

    m = over_sources(m)
    for _ in range(iters - 1):
        m = over_sources(over_targets(m))
    return m


def np_mixes(x, kernel):
    """One token: x [n, D], kernel [n, D, W] -> X̂ W [W] (weightless RMSNorm over n*D)."""
    n, d = x.shape
    mean_square = sum(x[i, e] ** 2 for i in range(n) for e in range(d)) / (n * d)
    normed = x / np.sqrt(mean_square + NORM_EPS)
    return np.array([sum(normed[i, e] * kernel[i, e, w] for i in range(n) for e in range(d))
                     for w in range(kernel.shape[-1])])


def np_sublayer_step(streams, fn, base, scale, sublayer):
    """Eq. 1 around `sublayer` ([D] -> [D]) per token: streams [B, T, n, D] -> the same."""
    streams = streams.astype(np.float64)
    out = np.zeros_like(streams)
    n = streams.shape[2]
    for b in range(streams.shape[0]):
        for t in range(streams.shape[1]):
            x = streams[b, t]
            m = np_mixes(x, fn)
            pre = [np_sigmoid(scale[0] * m[i] + base[i]) + HC_EPS for i in range(n)]
            post = [2 * np_sigmoid(scale[1] * m[n + i] + base[n + i]) for i in range(n)]
            logits = np.array([[scale[2] * m[2 * n + j * n + k] + base[2 * n + j * n + k]
                                for k in range(n)] for j in range(n)])
            res = np_sinkhorn(logits, ITERS, HC_EPS)
            y = sublayer(sum(pre[j] * x[j] for j in range(n)))
            for k in range(n):
                out[b, t, k] = post[k] * y + sum(res[j, k] * x[j] for j in range(n))
    return out


def np_head(streams, hc_fn, hc_base, hc_scale):
    streams = streams.astype(np.float64)
    out = np.zeros(streams.shape[:2] + streams.shape[3:])
    for b in range(streams.shape[0]):
        for t in range(streams.shape[1]):
            m = np_mixes(streams[b, t], hc_fn)
            for i in range(streams.shape[2]):
                pre = np_sigmoid(hc_scale[0] * m[i] + hc_base[i]) + HC_EPS
                out[b, t] += pre * streams[b, t, i]
    return out


# ---- helpers -----------------------------------------------------------------------------------


def _random_params(rng, n=N, d=D):
    """Non-trivial mHC and head params (upstream's init makes every mapping near-uniform)."""
    width = (2 + n) * n
    return (dict(fn=rng.normal(scale=0.3, size=(n, d, width)),
                 base=rng.normal(scale=0.5, size=width), scale=rng.uniform(0.5, 1.5, size=3)),
            dict(hc_fn=rng.normal(scale=0.3, size=(n, d, n)),
                 hc_base=rng.normal(scale=0.5, size=n), hc_scale=rng.uniform(0.5, 1.5, size=1)))


def _f32(tree):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)


def _sublayer_weight(rng, d=D):
    return rng.normal(scale=0.5, size=(d, d))


def _step(hc_params, streams, w):
    """Ours: one mHC-wrapped sublayer y = tanh(x W)."""
    hc = HyperConnection(sinkhorn_iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    x, mix = hc.apply({"params": hc_params}, streams)
    return expand_streams(streams, jnp.tanh(x @ w), mix)


def _head(head_params, streams):
    return HyperHead(hc_eps=HC_EPS, norm_eps=NORM_EPS).apply({"params": head_params}, streams)


# ---- Sinkhorn ----------------------------------------------------------------------------------


def test_sinkhorn_is_doubly_stochastic_and_matches_loop_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=2.0, size=(5, N, N))
    ours = np.asarray(sinkhorn(jnp.asarray(logits, jnp.float32), ITERS, HC_EPS))
    assert ours.dtype == np.float32
    assert np.all(ours > 0)
    np.testing.assert_allclose(ours.sum(axis=-2), 1.0, atol=1e-5)  # last step: over sources
    np.testing.assert_allclose(ours.sum(axis=-1), 1.0, atol=1e-3)  # converged after 20
    for i in range(logits.shape[0]):
        np.testing.assert_allclose(ours[i], np_sinkhorn(logits[i], ITERS, HC_EPS), rtol=1e-5,
                                   atol=1e-7)


@pytest.mark.parametrize("iters", [1, 3])
def test_sinkhorn_counts_iterations_like_upstream(iters):
    logits = np.random.default_rng(1).normal(scale=2.0, size=(N, N))
    ours = np.asarray(sinkhorn(jnp.asarray(logits, jnp.float32), iters, HC_EPS))
    np.testing.assert_allclose(ours, np_sinkhorn(logits, iters, HC_EPS), rtol=1e-5, atol=1e-7)


def test_sinkhorn_rejects_zero_iterations():
    with pytest.raises(ValueError, match="iters"):
        sinkhorn(jnp.zeros((N, N)), 0, HC_EPS)


# ---- the whole mapping against the loop references ---------------------------------------------


def test_sublayer_step_matches_loop_reference():
    rng = np.random.default_rng(2)
    hc_params, _ = _random_params(rng)
    streams, w = rng.normal(size=(B, T, N, D)), _sublayer_weight(rng)
    ours = _step(_f32(hc_params), jnp.asarray(streams, jnp.float32), jnp.asarray(w, jnp.float32))
    want = np_sublayer_step(streams, hc_params["fn"], hc_params["base"], hc_params["scale"],
                            lambda x: np.tanh(x @ w))
    np.testing.assert_allclose(np.asarray(ours), want, rtol=1e-4, atol=1e-5)


def test_head_matches_loop_reference():
    rng = np.random.default_rng(3)
    _, head_params = _random_params(rng)
    streams = rng.normal(size=(B, T, N, D))
    ours = _head(_f32(head_params), jnp.asarray(streams, jnp.float32))
    want = np_head(streams, **head_params)
    np.testing.assert_allclose(np.asarray(ours), want, rtol=1e-4, atol=1e-5)


def test_expand_embeddings_copies_into_every_stream():
    x = np.random.default_rng(4).normal(size=(B, T, D)).astype(np.float32)
    out = np.asarray(expand_embeddings(jnp.asarray(x), N))
    assert out.shape == (B, T, N, D)
    for i in range(N):
        np.testing.assert_array_equal(out[:, :, i], x)


def test_init_follows_upstream_and_names_the_hf_tensors():
    streams = jnp.ones((1, 1, N, D))
    hc = HyperConnection().init(jax.random.key(0), streams)["params"]
    head = HyperHead().init(jax.random.key(0), streams)["params"]
    shapes = {k: v.value.shape for k, v in {**hc, **head}.items()}
    assert shapes == {"fn": (N, D, 24), "base": (24,), "scale": (3,),
                      "hc_fn": (N, D, N), "hc_base": (N,), "hc_scale": (1,)}
    np.testing.assert_array_equal(hc["base"].value, 0.0)
    np.testing.assert_array_equal(hc["scale"].value, 1.0)
    np.testing.assert_array_equal(head["hc_scale"].value, 1.0)
    assert 0.01 < float(jnp.std(hc["fn"].value)) < 0.03  # N(0, 0.02)
    # The optimizer's split (report 2.4): kernels have two matrix axes -> Muon; the rest AdamW.
    assert hc["fn"].names == ("hc_streams", "embed", "hc_mix")
    assert len(hc["base"].names) == len(hc["scale"].names) == len(head["hc_base"].names) == 1


def test_bfloat16_streams_stay_bfloat16():
    rng = np.random.default_rng(5)
    hc_params, head_params = _random_params(rng)
    streams = jnp.asarray(rng.normal(size=(B, T, N, D)), jnp.bfloat16)
    w = jnp.asarray(_sublayer_weight(rng), jnp.bfloat16)
    out = _step(_f32(hc_params), streams, w)
    assert out.dtype == jnp.bfloat16 and _head(_f32(head_params), out).dtype == jnp.bfloat16
    want = np_sublayer_step(np.asarray(streams, np.float64), hc_params["fn"], hc_params["base"],
                            hc_params["scale"], lambda x: np.tanh(x @ np.asarray(w, np.float64)))
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=5e-2, atol=5e-2)


# ---- gradients ---------------------------------------------------------------------------------


def test_gradients_are_finite_and_nonzero_for_every_parameter():
    rng = np.random.default_rng(6)
    hc_params, head_params = _f32(_random_params(rng))
    streams = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    w = jnp.asarray(_sublayer_weight(rng), jnp.float32)
    target = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)

    def loss(hc_params, head_params, w, x):
        out = _head(head_params, _step(hc_params, expand_embeddings(x, N), w))
        return jnp.sum((out - target) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(hc_params, head_params, w, streams)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        g = np.asarray(g)
        assert np.all(np.isfinite(g)), path
        assert np.all(g != 0), path


# ---- parity with transformers ------------------------------------------------------------------


def _torch_modules(n=N, d=D, iters=ITERS):
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4HyperConnection,
        DeepseekV4HyperHead,
    )
    cfg = DeepseekV4Config(hidden_size=d, hc_mult=n, hc_sinkhorn_iters=iters, hc_eps=HC_EPS,
                           rms_norm_eps=NORM_EPS, num_hidden_layers=2, num_attention_heads=2,
                           vocab_size=32)
    return DeepseekV4HyperConnection(cfg), DeepseekV4HyperHead(cfg)


def _hf_fn(kernel):
    """Our [n, D, W] kernel -> HF's [W, n*D] weight (the checkpoint's layout)."""
    return kernel.reshape(-1, kernel.shape[-1]).T


@pytest.mark.parity
def test_hyper_connection_matches_transformers():
    import torch

    rng = np.random.default_rng(7)
    hc_params, _ = _random_params(rng)
    hc_params = jax.tree.map(lambda a: a.astype(np.float32), hc_params)
    torch_hc, _ = _torch_modules()
    with torch.no_grad():
        torch_hc.fn.copy_(torch.from_numpy(_hf_fn(hc_params["fn"])))
        torch_hc.base.copy_(torch.from_numpy(hc_params["base"]))
        torch_hc.scale.copy_(torch.from_numpy(hc_params["scale"]))
    streams = rng.normal(size=(B, T, N, D)).astype(np.float32)
    y = rng.normal(size=(B, T, D)).astype(np.float32)
    with torch.no_grad():
        hidden = torch.from_numpy(streams)
        post, comb, collapsed = torch_hc(hidden)
        # DeepseekV4DecoderLayer.forward's write-back
        want = post.unsqueeze(-1) * torch.from_numpy(y).unsqueeze(-2) + torch.matmul(
            comb.transpose(-1, -2), hidden)

    x, mix = HyperConnection(sinkhorn_iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS).apply(
        {"params": hc_params}, jnp.asarray(streams))
    np.testing.assert_allclose(np.asarray(x), collapsed.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(mix.post), post.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(mix.res), comb.numpy(), rtol=1e-4, atol=1e-6)
    out = expand_streams(jnp.asarray(streams), jnp.asarray(y), mix)
    np.testing.assert_allclose(np.asarray(out), want.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parity
def test_hyper_head_matches_transformers():
    import torch

    rng = np.random.default_rng(8)
    _, head_params = _random_params(rng)
    head_params = jax.tree.map(lambda a: a.astype(np.float32), head_params)
    _, torch_head = _torch_modules()
    with torch.no_grad():
        torch_head.hc_fn.copy_(torch.from_numpy(_hf_fn(head_params["hc_fn"])))
        torch_head.hc_base.copy_(torch.from_numpy(head_params["hc_base"]))
        torch_head.hc_scale.copy_(torch.from_numpy(head_params["hc_scale"]))
    streams = rng.normal(size=(B, T, N, D)).astype(np.float32)
    with torch.no_grad():
        want = torch_head(torch.from_numpy(streams)).numpy()
    ours = _head(head_params, jnp.asarray(streams))
    np.testing.assert_allclose(np.asarray(ours), want, rtol=1e-4, atol=1e-6)
