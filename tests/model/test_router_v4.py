"""DeepSeek-V4 routing math: the sqrt(softplus) affinity with the loss-free bias and
renormalised, scaled combine weights, and the sequence-wise balance loss (report 2.1, 4.2.2),
against float64 numpy references with explicit loops and against transformers' modules."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import MoEConfig
from model.layers.router import route, sequence_balance_loss, sqrt_softplus


def _cfg(**changes):
    base = dict(num_experts=8, top_k=3, routed_scaling_factor=1.5, num_ep_groups=1,
                router_activation="sqrt_softplus")
    return MoEConfig(**{**base, **changes})


def np_sqrt_softplus_route(logits, bias, top_k, scale, renormalize=True):
    """Per token: s = sqrt(log(1 + e^x)); top-k of s + b; weights = chosen s / sum * scale;
    probs = s / sum over all experts. Returns ({expert: weight} per token, probs [N, E])."""
    num_tokens, num_experts = logits.shape
    routes, probs = [], np.zeros((num_tokens, num_experts))
    for n in range(num_tokens):
        s = [math.sqrt(math.log1p(math.exp(float(v)))) for v in logits[n]]
        keyed = [s[e] + (0.0 if bias is None else float(bias[e])) for e in range(num_experts)]
        chosen = sorted(range(num_experts), key=lambda e: -keyed[e])[:top_k]
        total = sum(s[e] for e in chosen) if renormalize else 1.0
        routes.append({e: scale * s[e] / total for e in chosen})
        probs[n] = [v / sum(s) for v in s]
    return routes, probs


def _routes(indices, weights):
    return [dict(zip(map(int, i), map(float, w))) for i, w in zip(np.asarray(indices),
                                                                 np.asarray(weights))]


def _assert_same_routes(got, expected, rtol=1e-5):
    for g, e in zip(got, expected, strict=True):
        assert set(g) == set(e)
        np.testing.assert_allclose([g[k] for k in e], list(e.values()), rtol=rtol)


@pytest.mark.parametrize("with_bias", [False, True])
def test_sqrt_softplus_route_matches_reference(with_bias):
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=2.0, size=(24, 8)).astype(np.float32)
    bias = rng.normal(scale=0.4, size=8).astype(np.float32) if with_bias else None
    routing = route(jnp.asarray(logits), None if bias is None else jnp.asarray(bias), _cfg())
    expected, probs = np_sqrt_softplus_route(logits, bias, 3, 1.5)
    assert routing.indices.dtype == jnp.int32
    _assert_same_routes(_routes(routing.indices, routing.weights), expected)
    np.testing.assert_allclose(np.asarray(routing.probs), probs, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(routing.weights).sum(-1), 1.5, rtol=1e-5)
    if with_bias:  # the bias must change some choices, else the test proves nothing about it
        unbiased, _ = np_sqrt_softplus_route(logits, None, 3, 1.5)
        assert any(set(a) != set(b) for a, b in zip(expected, unbiased))


def test_sqrt_softplus_without_renormalisation():
    logits = np.random.default_rng(1).normal(size=(6, 8)).astype(np.float32)
    routing = route(jnp.asarray(logits), None, _cfg(renormalize=False))
    expected, _ = np_sqrt_softplus_route(logits, None, 3, 1.5, renormalize=False)
    _assert_same_routes(_routes(routing.indices, routing.weights), expected)


def test_sqrt_softplus_gradient_reaches_logits_not_bias_and_stays_finite():
    cfg = _cfg()
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(5, 8)), jnp.float32)
    logits = logits.at[0, :4].set(-150.0)  # softplus underflows to 0 here in float32
    bias = jnp.linspace(-0.3, 0.3, 8)

    def total(lg, b):
        r = route(lg, b, cfg)
        return jnp.sum(r.weights * jnp.arange(1.0, 4.0)) + jnp.sum(r.probs ** 2)

    g_logits, g_bias = jax.grad(total, argnums=(0, 1))(logits, bias)
    assert np.all(np.isfinite(np.asarray(g_logits)))
    assert np.count_nonzero(np.asarray(g_logits)[1:]) > 20
    assert np.all(np.asarray(g_bias) == 0)
    # d/dx sqrt(softplus(x)) = sigmoid(x) / (2 sqrt(softplus(x)))
    x = 0.7
    expected = (1 / (1 + math.exp(-x))) / (2 * math.sqrt(math.log1p(math.exp(x))))
    np.testing.assert_allclose(float(jax.grad(sqrt_softplus)(x)), expected, rtol=1e-6)


def np_sequence_balance_loss(probs, indices):
    """Per sequence b: f_i = E/(kT) * #{t: i chosen}, P_i = mean_t probs; sum_i f_i P_i; mean."""
    batch, length, num_experts = probs.shape
    top_k = indices.shape[-1]
    losses = []
    for b in range(batch):
        total = 0.0
        for i in range(num_experts):
            hits = sum(1 for t in range(length) for j in range(top_k) if indices[b, t, j] == i)
            f_i = num_experts / (top_k * length) * hits
            p_i = sum(probs[b, t, i] for t in range(length)) / length
            total += f_i * p_i
        losses.append(total)
    return sum(losses) / batch


def test_sequence_balance_loss_hand_built_case():
    # One sequence, E=4, k=1, T=2: both tokens choose expert 0 with p = [0.7, 0.1, 0.1, 0.1]
    # and [0.5, 0.3, 0.1, 0.1]: f_0 = E/(kT) * 2 = 4, f_else = 0, P_0 = 0.6, L = 2.4.
    probs = jnp.array([[[0.7, 0.1, 0.1, 0.1], [0.5, 0.3, 0.1, 0.1]]])
    indices = jnp.array([[[0], [0]]], jnp.int32)
    np.testing.assert_allclose(float(sequence_balance_loss(probs, indices)), 2.4, rtol=1e-6)
    uniform = jnp.full((1, 4, 4), 0.25)
    spread = jnp.arange(4, dtype=jnp.int32).reshape(1, 4, 1)
    np.testing.assert_allclose(float(sequence_balance_loss(uniform, spread)), 1.0, rtol=1e-6)


def test_sequence_balance_loss_matches_reference_per_sequence():
    rng = np.random.default_rng(3)
    probs = rng.dirichlet(np.ones(8), size=(3, 10)).astype(np.float32)
    indices = np.stack([[rng.choice(8, 3, replace=False) for _ in range(10)] for _ in range(3)])
    got = float(sequence_balance_loss(jnp.asarray(probs), jnp.asarray(indices, jnp.int32)))
    np.testing.assert_allclose(got, np_sequence_balance_loss(probs, indices), rtol=1e-5)
    # sequence-wise, not batch-wise: pooling the batch gives another value here
    pooled = np_sequence_balance_loss(probs.reshape(1, 30, 8), indices.reshape(1, 30, 3))
    assert abs(got - pooled) > 1e-3


def test_sequence_balance_loss_gradient_through_router_weights():
    rng = np.random.default_rng(4)
    cfg = _cfg()
    x = jnp.asarray(rng.normal(size=(2, 6, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(5, 8)), jnp.float32)

    def loss(w):
        r = route((x @ w).reshape(12, 8), None, cfg)
        return sequence_balance_loss(r.probs.reshape(2, 6, 8), r.indices.reshape(2, 6, 3))

    g = np.asarray(jax.grad(loss)(w))
    assert np.all(np.isfinite(g)) and np.count_nonzero(g) == g.size


@pytest.mark.parity
def test_top_k_router_parity_with_transformers():
    import torch
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    config = DeepseekV4Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=3,
                              vocab_size=50, moe_intermediate_size=12, num_hidden_layers=2)
    assert config.scoring_func == "sqrtsoftplus" and config.routed_scaling_factor == 1.5
    torch.manual_seed(0)
    router = DeepseekV4TopKRouter(config)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
        router.e_score_correction_bias.normal_(0.0, 0.3)
    hidden = torch.randn(2, 7, 16)
    with torch.no_grad():
        logits_t, weights_t, indices_t = router(hidden)

    w = jnp.asarray(router.weight.detach().numpy())  # [E, D], transformers' `gate.weight`
    logits = jnp.asarray(hidden.numpy()).reshape(14, 16) @ w.T
    routing = route(logits, jnp.asarray(router.e_score_correction_bias.numpy()), _cfg())
    np.testing.assert_allclose(np.asarray(logits), logits_t.numpy(), rtol=1e-5, atol=1e-6)
    _assert_same_routes(_routes(routing.indices, routing.weights),
                        _routes(indices_t.numpy(), weights_t.numpy()), rtol=1e-4)
    unbiased = route(logits, None, _cfg())  # the bias moved some choices
    assert not np.array_equal(np.sort(np.asarray(unbiased.indices)),
                              np.sort(indices_t.numpy()))


@pytest.mark.parity
def test_sequence_balance_loss_against_transformers_load_balancing_loss():
    """transformers' load_balancing_loss_func is Switch's batch-wise loss on softmax(logits):
    E * sum_e (count_e / T) * mean_t p_e. For one sequence with softmax probabilities and the
    unbiased top-k it is k times the report's f_i = E/(kT) count form."""
    import torch
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import load_balancing_loss_func

    logits = np.random.default_rng(5).normal(size=(12, 8)).astype(np.float32)
    expected = float(load_balancing_loss_func((torch.from_numpy(logits),), 8, 3))
    probs = jax.nn.softmax(jnp.asarray(logits), axis=-1)
    indices = jax.lax.top_k(probs, 3)[1]
    got = float(sequence_balance_loss(probs[None], indices[None]))
    np.testing.assert_allclose(3 * got, expected, rtol=1e-5)


def test_sequence_balance_loss_leaves_padding_out():
    """Padding is no part of a sequence: f, P and T count its tokens only (the float64 loop on
    the valid tokens alone), whatever the padding routed to; a row of padding alone leaves the
    mean over sequences."""
    rng = np.random.default_rng(5)
    probs = rng.dirichlet(np.ones(8), size=(3, 10)).astype(np.float32)
    indices = np.stack([[rng.choice(8, 3, replace=False) for _ in range(10)] for _ in range(3)])
    valid = np.ones((3, 10), bool)
    valid[0, 6:] = False  # a padded row
    valid[2] = False  # a row of padding alone
    got = float(sequence_balance_loss(jnp.asarray(probs), jnp.asarray(indices, jnp.int32),
                                      jnp.asarray(valid)))
    want = (np_sequence_balance_loss(probs[:1, :6], indices[:1, :6])
            + np_sequence_balance_loss(probs[1:2], indices[1:2])) / 2
    np.testing.assert_allclose(got, want, rtol=1e-5)
    full = float(sequence_balance_loss(jnp.asarray(probs[1:2]), jnp.asarray(indices[1:2])))
    np.testing.assert_allclose(full, np_sequence_balance_loss(probs[1:2], indices[1:2]), rtol=1e-5)
