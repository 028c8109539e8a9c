"""The router (sigmoid and softmax scoring, the loss-free bias, renormalisation), expert load,
the EP-group balance loss (report eq. 1) and routing confidence, against the independent float64
numpy references of tests/moe_references.py."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_references import (
    assert_routes_equal,
    np_ep_balance_loss,
    np_route,
    np_sigmoid,
    np_softmax,
    routes_of,
)

from model.config import MoEConfig
from model.layers.router import ep_group_balance_loss, expert_load, route, routing_confidence

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


# ---- router ------------------------------------------------------------------------------------


def _moe_cfg(**changes):
    base = dict(num_experts=8, top_k=3, routed_scaling_factor=3.0, num_ep_groups=4)
    return MoEConfig(**{**base, **changes})


@pytest.mark.parametrize("with_bias", [False, True])
def test_sigmoid_router_matches_reference(with_bias):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(20, 8)).astype(np.float32)
    bias = rng.normal(scale=0.3, size=8).astype(np.float32) if with_bias else None
    cfg = _moe_cfg()
    routing = route(jnp.asarray(logits), None if bias is None else jnp.asarray(bias), cfg)
    expected, probs = np_route(logits, bias, 3)
    assert routing.indices.shape == (20, 3) and routing.indices.dtype == jnp.int32
    assert_routes_equal(routes_of(routing.indices, routing.weights), expected)
    np.testing.assert_allclose(np.asarray(routing.probs), probs, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(routing.probs).sum(-1), 1.0, rtol=1e-5)
    # renormalised: each token's weights sum to the scaling factor
    np.testing.assert_allclose(np.asarray(routing.weights).sum(-1), 3.0, rtol=1e-5)
    if with_bias:  # this bias must actually change some selections, else the test is vacuous
        unbiased, _ = np_route(logits, None, 3)
        assert any(set(a) != set(b) for a, b in zip(expected, unbiased))


def test_bias_changes_selection_but_not_the_weights_of_a_chosen_set():
    # Scores: sigmoid(2) > sigmoid(1) > sigmoid(0) > sigmoid(-1); top-2 = {0, 1} without bias.
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0]] * 3)
    bias = jnp.array([0.0, 0.0, 1.0, 0.0])  # expert 2: 0.5 + 1 > sigmoid(1): flips the choice
    cfg = MoEConfig(num_experts=4, top_k=2, routed_scaling_factor=3.0, num_ep_groups=1)
    s = np_sigmoid(np.array([2.0, 1.0, 0.0, -1.0]))

    plain = routes_of(*route(logits, None, cfg)[:2])[0]
    assert set(plain) == {0, 1}
    np.testing.assert_allclose(plain[0], 3 * s[0] / (s[0] + s[1]), rtol=1e-6)

    flipped = routes_of(*route(logits, bias, cfg)[:2])[0]
    assert set(flipped) == {0, 2}
    # weights are the *unbiased* scores of {0, 2}, renormalised: bias 1.0 does not enter
    np.testing.assert_allclose(flipped[0], 3 * s[0] / (s[0] + s[2]), rtol=1e-6)
    np.testing.assert_allclose(flipped[2], 3 * s[2] / (s[0] + s[2]), rtol=1e-6)

    # a bias that keeps the selection leaves the weights bit-for-bit unchanged
    same_set = routes_of(*route(logits, jnp.array([0.3, 0.2, 0.0, -0.5]), cfg)[:2])[0]
    assert same_set == plain

    # probabilities (for eq. 1) do not see the bias either
    np.testing.assert_array_equal(np.asarray(route(logits, bias, cfg).probs),
                                  np.asarray(route(logits, None, cfg).probs))


def test_bias_receives_no_gradient_but_logits_do():
    cfg = _moe_cfg()
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(6, 8)), jnp.float32)
    bias = jnp.linspace(-0.2, 0.2, 8)

    def total(lg, b):
        r = route(lg, b, cfg)
        return jnp.sum(r.weights * jnp.arange(1, 4)) + jnp.sum(r.probs**2)

    g_logits, g_bias = jax.grad(total, argnums=(0, 1))(logits, bias)
    assert np.all(np.asarray(g_bias) == 0)
    assert np.any(np.asarray(g_logits) != 0)


def test_softmax_router_matches_reference():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(15, 8)).astype(np.float32)
    bias = rng.normal(scale=0.05, size=8).astype(np.float32)
    cfg = _moe_cfg(router_activation="softmax", top_k=2, routed_scaling_factor=1.5)
    routing = route(jnp.asarray(logits), jnp.asarray(bias), cfg)
    expected, _ = np_route(logits, bias, 2, activation="softmax", scale=1.5)
    assert_routes_equal(routes_of(routing.indices, routing.weights), expected)
    np.testing.assert_allclose(np.asarray(routing.probs), np_softmax(logits.astype(np.float64)),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("activation", ["sigmoid", "softmax"])
def test_router_without_renormalisation(activation):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(10, 8)).astype(np.float32)
    cfg = _moe_cfg(router_activation=activation, renormalize=False, routed_scaling_factor=2.0)
    routing = route(jnp.asarray(logits), None, cfg)
    expected, _ = np_route(logits, None, 3, activation=activation, renormalize=False, scale=2.0)
    assert_routes_equal(routes_of(routing.indices, routing.weights), expected)
    assert not np.allclose(np.asarray(routing.weights).sum(-1), 2.0)


def test_expert_load_counts_routed_copies():
    indices = jnp.array([[0, 3], [3, 1], [3, 0], [2, 3]], jnp.int32)
    load = np.asarray(expert_load(indices, 6))
    expected = np.zeros(6)
    for row in np.asarray(indices):
        for e in row:
            expected[e] += 1.0 / indices.size
    np.testing.assert_allclose(load, expected, rtol=1e-6)


def test_ep_group_balance_loss_matches_eq1_with_loops():
    rng = np.random.default_rng(4)
    for num_experts, groups in [(8, 4), (12, 3), (16, 1), (6, 6)]:
        load = rng.dirichlet(np.ones(num_experts)).astype(np.float32)
        probs = rng.dirichlet(np.ones(num_experts)).astype(np.float32)
        got = float(ep_group_balance_loss(jnp.asarray(load), jnp.asarray(probs), groups))
        np.testing.assert_allclose(got, np_ep_balance_loss(load, probs, groups), rtol=1e-5)


def test_ep_group_balance_loss_from_routing_against_eq1():
    """Eq. 1 end to end: p_e = mean_t p_te, f_e = (1/TK) sum_t s_te from the router's choices."""
    rng = np.random.default_rng(5)
    cfg = _moe_cfg(top_k=2)
    logits = rng.normal(size=(32, 8)).astype(np.float32)
    r = route(jnp.asarray(logits), None, cfg)
    got = float(ep_group_balance_loss(expert_load(r.indices, 8), jnp.mean(r.probs, 0), 4))
    routes, probs = np_route(logits, None, 2)
    f = np.zeros(8)
    for chosen in routes:
        for e in chosen:
            f[e] += 1.0 / (32 * 2)
    np.testing.assert_allclose(got, np_ep_balance_loss(f, probs.mean(0), 4), rtol=1e-5)


@pytest.mark.parametrize("groups", [1, 2, 4, 8])
def test_ep_group_balance_loss_is_one_when_uniform(groups):
    uniform = jnp.full((8,), 1 / 8)
    np.testing.assert_allclose(float(ep_group_balance_loss(uniform, uniform, groups)), 1.0, rtol=1e-6)


def test_ep_group_balance_loss_gradient_flows_only_through_probs():
    rng = np.random.default_rng(6)
    load = jnp.asarray(rng.dirichlet(np.ones(8)), jnp.float32)
    probs = jnp.asarray(rng.dirichlet(np.ones(8)), jnp.float32)
    g_load, g_probs = jax.grad(ep_group_balance_loss, argnums=(0, 1))(load, probs, 4)
    assert np.all(np.asarray(g_load) == 0)
    # dL/dp_e = G * f_g(e)
    f_groups = np.asarray(load).reshape(4, 2).sum(-1)
    np.testing.assert_allclose(np.asarray(g_probs), 4 * np.repeat(f_groups, 2), rtol=1e-6)


def test_routing_confidence_is_mass_of_chosen_experts():
    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.ones(8), size=5).astype(np.float32)
    indices = np.array([[0, 1], [7, 2], [3, 3], [4, 5], [6, 0]], np.int32)
    got = np.asarray(routing_confidence(jnp.asarray(probs), jnp.asarray(indices)))
    expected = [sum(float(probs[n, e]) for e in indices[n]) for n in range(5)]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
