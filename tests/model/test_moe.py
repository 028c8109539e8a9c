"""Router, routed-expert dispatch and the `MoE` module against independent float64 numpy
references written with explicit loops (DESIGN.md §3, report eq. 1 and 4.1.3)."""

from __future__ import annotations

import functools
import zlib
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import MoEConfig, load_config
from model.layers.moe import MoE
from model.lm import collect_aux
from model.ops.moe_dispatch import ExpertWeights, row_block_size
from model.layers.moe import routed_experts
from model.layers.router import ep_group_balance_loss, expert_load, route, routing_confidence

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
# Tests compile many small programs; LLVM optimisation level 0 halves XLA:CPU compile time and
# does not change what is computed (same HLO; no fast-math either way).
FAST = {"xla_backend_optimization_level": 0}


def fast_jit(fn, **kwargs):
    return jax.jit(fn, compiler_options=FAST, **kwargs)


# ---- independent numpy references (float64) ----------------------------------------------------


def np_sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_route(logits, bias, top_k, activation="sigmoid", renormalize=True, scale=3.0):
    """Returns (list of {expert: weight} per token, probs [N, E], chosen sets)."""
    logits = np.asarray(logits, np.float64)
    scores = np_sigmoid(logits) if activation == "sigmoid" else np_softmax(logits)
    probs = scores / scores.sum(-1, keepdims=True)
    selection = scores + (0.0 if bias is None else np.asarray(bias, np.float64))
    routes = []
    for n in range(logits.shape[0]):
        chosen = sorted(range(logits.shape[1]), key=lambda e: -selection[n, e])[:top_k]
        weights = np.array([scores[n, e] for e in chosen])  # unbiased scores
        if renormalize:
            weights = weights / weights.sum()
        routes.append({e: w * scale for e, w in zip(chosen, weights)})
    return routes, probs


def np_swiglu(x, w_gate, w_up, w_down, limit):
    gate_pre, up = x @ w_gate, x @ w_up
    gate = gate_pre * np_sigmoid(gate_pre)  # silu
    if limit > 0:
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
    h = gate * up
    return h @ w_down, h


def np_routed_experts(x, indices, combine, wg, wu, wd, limit):
    """Per-token loop over the chosen experts; returns (y, stats dict)."""
    x, combine = np.asarray(x, np.float64), np.asarray(combine, np.float64)
    wg, wu, wd = (np.asarray(w, np.float64) for w in (wg, wu, wd))
    num_tokens, top_k = indices.shape
    num_experts, hidden = wg.shape[0], wg.shape[2]
    y = np.zeros_like(x)
    count = np.zeros(num_experts)
    h_sq = np.zeros(num_experts)
    norm_sum = np.zeros(num_experts)
    norm_max = np.zeros(num_experts)
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(indices[t, j])
            out, h = np_swiglu(x[t], wg[e], wu[e], wd[e], limit)
            y[t] += combine[t, j] * out
            count[e] += 1
            h_sq[e] += np.sum(h**2)
            norm = np.linalg.norm(out)
            norm_sum[e] += norm
            norm_max[e] = max(norm_max[e], norm)
    safe = np.maximum(count, 1)
    stats = {
        "expert_tokens": count,
        "expert_act_rms": np.sqrt(h_sq / (safe * hidden)),
        "expert_out_norm_mean": norm_sum / safe,
        "expert_out_norm_max": norm_max,
    }
    return y, stats


def np_ep_balance_loss(load, mean_probs, num_groups):
    """Eq. 1 with explicit loops: L = G * sum_g f_g p_g over contiguous expert groups."""
    num_experts = len(load)
    size = num_experts // num_groups
    total = 0.0
    for g in range(num_groups):
        f_g = sum(float(load[e]) for e in range(g * size, (g + 1) * size))
        p_g = sum(float(mean_probs[e]) for e in range(g * size, (g + 1) * size))
        total += f_g * p_g
    return num_groups * total


def routes_of(indices, weights):
    """Module routing output -> list of {expert: weight} (order of the k slots is irrelevant)."""
    indices, weights = np.asarray(indices), np.asarray(weights)
    return [{int(e): float(w) for e, w in zip(row_i, row_w)} for row_i, row_w in zip(indices, weights)]


def assert_routes_equal(got, expected, rtol=1e-5):
    assert len(got) == len(expected)
    for n, (g, e) in enumerate(zip(got, expected)):
        assert set(g) == set(e), f"token {n}: experts {sorted(g)} != {sorted(e)}"
        for expert in e:
            np.testing.assert_allclose(g[expert], e[expert], rtol=rtol, atol=1e-6)


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


# ---- routed experts ----------------------------------------------------------------------------

IMPLS = ["sorted", "ragged_dot"]


def _distinct_choices(rng, num_tokens, num_experts, top_k, allowed=None):
    allowed = np.arange(num_experts) if allowed is None else np.asarray(allowed)
    return np.stack([rng.choice(allowed, size=top_k, replace=False) for _ in range(num_tokens)])


def _case(name):
    """(x, indices, combine, ExpertWeights as numpy, limit, block_size) for a named routing case."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    limit, block_size, d_model, hidden = 0.0, 128, 8, 12
    if name == "random":
        n, e, k = 24, 6, 2
        idx = _distinct_choices(rng, n, e, k)
    elif name == "random_clamped":
        n, e, k = 24, 6, 2
        idx = _distinct_choices(rng, n, e, k)
        limit = 0.5
    elif name == "empty_experts":  # experts 0, 2, 3, 4, 5, 7 receive nothing
        n, e, k = 16, 8, 2
        idx = _distinct_choices(rng, n, e, k, allowed=[1, 6])
    elif name == "one_expert":
        n, e, k = 16, 4, 1
        idx = np.full((n, 1), 2)
    elif name == "more_experts_than_tokens":
        n, e, k = 3, 16, 2
        idx = _distinct_choices(rng, n, e, k)
    elif name == "rows_not_multiple_of_block":  # 39 rows, block 8
        n, e, k = 13, 5, 3
        idx = _distinct_choices(rng, n, e, k)
        block_size = 8
    elif name == "many_blocks_per_expert":  # ~32 rows per expert, block 8
        n, e, k = 64, 4, 2
        idx = _distinct_choices(rng, n, e, k)
        block_size, limit = 8, 0.7
    elif name == "skewed":  # 33 rows to expert 0, one each to 1..7: the static block bound is tight
        n, e, k = 40, 8, 1
        idx = np.concatenate([np.zeros(33, int), np.arange(1, 8)])[rng.permutation(40)][:, None]
    elif name == "block_below_8":
        n, e, k = 20, 3, 2
        idx = _distinct_choices(rng, n, e, k)
        block_size = 4
    else:
        raise KeyError(name)
    x = rng.normal(size=(n, d_model)).astype(np.float32)
    combine = rng.uniform(0.2, 1.5, size=(n, k)).astype(np.float32)
    weights = ExpertWeights(
        gate=(rng.normal(size=(e, d_model, hidden)) / np.sqrt(d_model)).astype(np.float32),
        up=(rng.normal(size=(e, d_model, hidden)) / np.sqrt(d_model)).astype(np.float32),
        down=(rng.normal(size=(e, hidden, d_model)) / np.sqrt(hidden)).astype(np.float32),
    )
    return x, idx.astype(np.int32), combine, weights, limit, block_size


CASES = ["random", "random_clamped", "empty_experts", "one_expert", "more_experts_than_tokens",
         "rows_not_multiple_of_block", "many_blocks_per_expert", "skewed", "block_below_8"]


@functools.lru_cache(maxsize=None)
def _jitted_routed(impl, limit, block_size):
    return fast_jit(functools.partial(routed_experts, limit=limit, impl=impl, block_size=block_size))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", CASES)
def test_routed_experts_match_per_token_reference(impl, name):
    x, idx, combine, w, limit, block_size = _case(name)
    y, stats = _jitted_routed(impl, limit, block_size)(x, idx, combine, w)
    ref_y, ref_stats = np_routed_experts(x, idx, combine, *w, limit)
    assert y.shape == x.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), ref_y, rtol=1e-4, atol=1e-5)
    assert set(stats) == set(ref_stats)
    for key, ref in ref_stats.items():
        assert stats[key].shape == (w.gate.shape[0],), key
        np.testing.assert_allclose(np.asarray(stats[key]), ref, rtol=1e-4, atol=1e-6, err_msg=key)
    empty = ref_stats["expert_tokens"] == 0
    for key in ref_stats:
        assert np.all(np.asarray(stats[key])[empty] == 0), key
    if limit > 0:  # the clamp must actually bind somewhere, or this case tests nothing
        unclamped, _ = np_routed_experts(x, idx, combine, *w, 0.0)
        assert not np.allclose(unclamped, ref_y, atol=1e-3)


def test_routed_experts_with_duplicate_expert_in_one_token():
    # Not produced by top-k, but the dispatch must still add both copies.
    x, _, combine, w, _, _ = _case("random")
    idx = np.tile(np.array([[4, 4]], np.int32), (x.shape[0], 1))
    for impl in IMPLS:
        y, stats = _jitted_routed(impl, 0.0, 128)(x, idx, combine, w)
        ref_y, _ = np_routed_experts(x, idx, combine, *w, 0.0)
        np.testing.assert_allclose(np.asarray(y), ref_y, rtol=1e-4, atol=1e-5)
        assert float(stats["expert_tokens"][4]) == 2 * x.shape[0]


def _dense_reference(x, idx, combine, w, limit):
    """Every expert on every token, weighted by a dense [N, E] combine matrix (jnp, float32)."""
    n, e = x.shape[0], w.gate.shape[0]
    dense = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], idx].add(combine)
    gate_pre = jnp.einsum("nd,edf->nef", x, w.gate)
    up = jnp.einsum("nd,edf->nef", x, w.up)
    gate = jax.nn.silu(gate_pre)
    if limit > 0:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    out = jnp.einsum("nef,efd->ned", gate * up, w.down)
    return jnp.einsum("ned,ne->nd", out, dense)


@pytest.mark.parametrize("name", ["random_clamped", "empty_experts", "many_blocks_per_expert", "skewed"])
def test_routed_expert_gradients_agree(name):
    x, idx, combine, w, limit, block_size = _case(name)
    probe = np.random.default_rng(8).normal(size=x.shape).astype(np.float32)
    idx_j = jnp.asarray(idx)

    def loss_of(fn):
        def loss(x, combine, w):
            return jnp.sum(fn(x, idx_j, combine, w) * probe)
        return fast_jit(jax.grad(loss, argnums=(0, 1, 2)))

    grads = {"dense": loss_of(lambda *a: _dense_reference(*a, limit))(x, combine, w)}
    for impl in IMPLS:
        fn = functools.partial(routed_experts, limit=limit, impl=impl, block_size=block_size)
        grads[impl] = loss_of(lambda *a, fn=fn: fn(*a)[0])(x, combine, w)
    names = ["x", "combine", "gate", "up", "down"]
    ref = jax.tree.leaves(grads["dense"])
    for impl in IMPLS:
        for label, got, want in zip(names, jax.tree.leaves(grads[impl]), ref):
            scale = float(np.max(np.abs(want))) or 1.0
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                                       atol=1e-5 * scale, err_msg=f"{impl} d{label}")
    # experts that got no rows get exactly zero weight gradient
    unused = np.setdiff1d(np.arange(w.gate.shape[0]), idx)
    for impl in IMPLS:
        for leaf in jax.tree.leaves(grads[impl][2]):
            assert np.all(np.asarray(leaf)[unused] == 0)


def test_row_block_size_invariants():
    for max_block in (8, 16, 32, 128, 256):
        for experts in (1, 3, 4, 16, 288):
            previous = 0
            for rows in list(range(1, 300)) + [512, 1000, 4096, 10_000, 65_536, 300_000]:
                block = row_block_size(rows, experts, max_block)
                assert isinstance(block, int)
                assert min(8, max_block) <= block <= max_block
                assert block & (block - 1) == 0  # power of two (max_block is one here)
                assert block >= previous  # monotone in the number of rows
                previous = block
                if block < max_block:
                    # at least the quarter-of-mean-rows target ...
                    assert block >= rows // (4 * experts)
                if 8 < block < max_block:
                    # ... and at most ~2x it, so worst-case padding E*(block-1) < rows/2
                    assert experts * (block - 1) < rows / 2
    # a max_block below 8 is respected
    assert row_block_size(1000, 2, 4) == 4
    assert row_block_size(1000, 2, 1) == 1


# ---- the MoE module ----------------------------------------------------------------------------

D_MODEL, EXPERTS, TOP_K, HIDDEN, SHARED_HIDDEN, GROUPS = 16, 8, 2, 12, 10, 4
LIMIT, SHARED_LIMIT = 0.4, 0.6


def _module_cfg(impl="sorted", compute_dtype="float32"):
    return load_config(TINY, overrides=[
        f"d_model={D_MODEL}", f"moe.num_experts={EXPERTS}", f"moe.top_k={TOP_K}",
        f"moe.expert_hidden={HIDDEN}", f"moe.shared_hidden={SHARED_HIDDEN}",
        f"moe.num_ep_groups={GROUPS}", f"moe_impl={impl}", f"compute_dtype={compute_dtype}",
        "moe.block_size=8",
    ])


@pytest.fixture(scope="module")
def moe_setup():
    """Params with our own random values (scales chosen so both clamps bind)."""
    cfg = _module_cfg()
    x = jnp.asarray(np.random.default_rng(9).normal(size=(2, 7, D_MODEL)), jnp.float32)
    shapes = nn.unbox(jax.eval_shape(MoE(cfg, LIMIT, SHARED_LIMIT).init, jax.random.PRNGKey(0), x))
    rng = np.random.default_rng(10)

    def fill(path, leaf):
        fan_in = leaf.shape[-2] if leaf.ndim >= 2 else 1
        return jnp.asarray(rng.normal(size=leaf.shape) / np.sqrt(fan_in), leaf.dtype)

    params = jax.tree_util.tree_map_with_path(fill, shapes["params"])
    return cfg, x, params, shapes


def _apply(cfg, params, bias, x):
    apply = _jitted_moe_apply(cfg.moe_impl, cfg.compute_dtype)
    return apply({"params": params, "balance": {"router_bias": bias}}, x)


@functools.lru_cache(maxsize=None)
def _jitted_moe_apply(impl, compute_dtype):
    return fast_jit(MoE(_module_cfg(impl, compute_dtype), LIMIT, SHARED_LIMIT).apply)


def _np_moe(params, bias, x):
    """Reference MoE output and aux from the module's params, in float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    tokens = np.asarray(x, np.float64).reshape(-1, D_MODEL)
    routes, probs = np_route(tokens @ p["router"], bias, TOP_K)
    indices = np.array([sorted(r) for r in routes])
    combine = np.array([[r[e] for e in sorted(r)] for r in routes])
    y, stats = np_routed_experts(tokens, indices, combine, p["gate_proj"], p["up_proj"],
                                 p["down_proj"], LIMIT)
    shared = p["shared_expert"]
    shared_out, _ = np_swiglu(tokens, shared["gate_proj"]["kernel"], shared["up_proj"]["kernel"],
                              shared["down_proj"]["kernel"], SHARED_LIMIT)
    load = stats["expert_tokens"] / indices.size
    aux = {
        "expert_load": load,
        "expert_prob": probs.mean(0),
        "routing_confidence": np.array([sum(probs[n, e] for e in r) for n, r in enumerate(routes)]),
        **stats,
    }
    return (y + shared_out).reshape(x.shape), aux, routes


def test_collect_aux_forms_the_eq1_balance_loss_from_layer_aux(moe_setup):
    _, x, params, _ = moe_setup
    cfg = _module_cfg("sorted").replace(gate="none")
    _, aux = _apply(cfg, params, jnp.zeros(EXPERTS), x)
    per_layer = [aux if cfg.is_moe_layer(i) else {} for i in range(cfg.num_layers)]
    collected = collect_aux(cfg, per_layer)
    ref = np_ep_balance_loss(np.asarray(aux["expert_load"], np.float64),
                             np.asarray(aux["expert_prob"], np.float64), GROUPS)
    assert GROUPS == cfg.moe.num_ep_groups
    np.testing.assert_allclose(float(collected["balance_loss"]), ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(collected["moe"]["balance_loss"]),
                               ref, rtol=1e-5)


def test_moe_param_layout(moe_setup):
    _, _, _, shapes = moe_setup
    params = shapes["params"]
    assert set(params) == {"router", "gate_proj", "up_proj", "down_proj", "shared_expert"}
    assert params["router"].shape == (D_MODEL, EXPERTS)
    assert params["router"].dtype == jnp.float32
    assert params["gate_proj"].shape == (EXPERTS, D_MODEL, HIDDEN)
    assert params["up_proj"].shape == (EXPERTS, D_MODEL, HIDDEN)
    assert params["down_proj"].shape == (EXPERTS, HIDDEN, D_MODEL)
    assert params["shared_expert"]["gate_proj"]["kernel"].shape == (D_MODEL, SHARED_HIDDEN)
    assert params["shared_expert"]["down_proj"]["kernel"].shape == (SHARED_HIDDEN, D_MODEL)
    assert shapes["balance"]["router_bias"].shape == (EXPERTS,)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bias_kind", ["zero", "random"])
def test_moe_module_matches_reference(moe_setup, impl, bias_kind):
    cfg, x, params, _ = moe_setup
    cfg = _module_cfg(impl)
    bias = (np.zeros(EXPERTS, np.float32) if bias_kind == "zero"
            else np.random.default_rng(11).normal(scale=0.3, size=EXPERTS).astype(np.float32))
    y, aux = _apply(cfg, params, jnp.asarray(bias), x)
    ref_y, ref_aux, routes = _np_moe(params, bias, x)
    np.testing.assert_allclose(np.asarray(y), ref_y, rtol=1e-4, atol=1e-5)
    assert set(aux) == set(ref_aux)
    n = x.shape[0] * x.shape[1]
    expected_shapes = {k: (EXPERTS,) for k in ref_aux}
    expected_shapes.update(routing_confidence=x.shape[:2])
    for key, ref in ref_aux.items():
        assert aux[key].shape == expected_shapes[key], key
        np.testing.assert_allclose(np.asarray(aux[key]).reshape(np.shape(ref)), ref, rtol=1e-4,
                                   atol=1e-6, err_msg=key)
    # dropless: every token has exactly top_k distinct experts, all computed
    assert all(len(r) == TOP_K for r in routes)
    assert float(jnp.sum(aux["expert_tokens"])) == n * TOP_K
    if bias_kind == "random":  # this bias changes some choices, so the test checks the bias path
        unbiased = _np_moe(params, np.zeros(EXPERTS), x)[2]
        assert any(set(a) != set(b) for a, b in zip(routes, unbiased))
    # the clamps bind for these params (so the reference comparison covers them)
    tokens = np.asarray(x, np.float64).reshape(-1, D_MODEL)
    shared = params["shared_expert"]
    gate_pre = tokens @ np.asarray(shared["gate_proj"]["kernel"], np.float64)
    assert np.any(gate_pre * np_sigmoid(gate_pre) > SHARED_LIMIT)


def test_uniform_bias_changes_nothing_and_large_bias_forces_experts(moe_setup):
    cfg, x, params, _ = moe_setup
    zero = jnp.zeros(EXPERTS)
    y0, aux0 = _apply(cfg, params, zero, x)
    # adding the same constant to every expert's bias keeps every selection and every weight
    y1, aux1 = _apply(cfg, params, zero + 5.0, x)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))
    np.testing.assert_array_equal(np.asarray(aux1["expert_tokens"]), np.asarray(aux0["expert_tokens"]))
    # a large bias on experts 5 and 2 sends every token there (no capacity drop), while the
    # combine weights stay the unbiased scores of {2, 5}
    forced = np.zeros(EXPERTS, np.float32)
    forced[[2, 5]] = 10.0
    y2, aux2 = _apply(cfg, params, jnp.asarray(forced), x)
    n = x.shape[0] * x.shape[1]
    expected_tokens = np.zeros(EXPERTS)
    expected_tokens[[2, 5]] = n
    np.testing.assert_array_equal(np.asarray(aux2["expert_tokens"]), expected_tokens)
    ref_y, _, routes = _np_moe(params, forced, x)
    assert all(set(r) == {2, 5} for r in routes)
    np.testing.assert_allclose(np.asarray(y2), ref_y, rtol=1e-4, atol=1e-5)
    assert not np.allclose(np.asarray(y2), np.asarray(y0), atol=1e-3)


def test_router_runs_in_float32_under_bfloat16_compute(moe_setup):
    """DESIGN.md §2: router in float32 whatever the compute dtype. With bf16 compute the
    routing probabilities must still agree with a float64 reference to float32 precision
    (a bf16 router would be off by ~1e-3)."""
    _, x, params, _ = moe_setup
    cfg = _module_cfg(compute_dtype="bfloat16")
    x_bf16 = x.astype(jnp.bfloat16)
    bias = jnp.zeros(EXPERTS)
    y, aux = _apply(cfg, params, bias, x_bf16)
    assert y.dtype == jnp.bfloat16
    _, ref_aux, _ = _np_moe(params, np.zeros(EXPERTS), np.asarray(x_bf16.astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(aux["expert_prob"]), ref_aux["expert_prob"], rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(np.asarray(aux["routing_confidence"]).reshape(-1),
                               ref_aux["routing_confidence"], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(aux["expert_tokens"]), ref_aux["expert_tokens"])


def test_moe_without_shared_expert_and_without_bias(moe_setup):
    _, x, params, _ = moe_setup
    cfg = load_config(TINY, overrides=[
        f"d_model={D_MODEL}", f"moe.num_experts={EXPERTS}", f"moe.top_k={TOP_K}",
        f"moe.expert_hidden={HIDDEN}", f"moe.num_ep_groups={GROUPS}", "moe.num_shared_experts=0",
        "moe.router_bias=false"])
    module = MoE(cfg, LIMIT, SHARED_LIMIT)
    shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), x)
    assert set(shapes) == {"params"}  # no `balance` collection without the bias
    assert "shared_expert" not in shapes["params"]
    routed_params = {k: v for k, v in params.items() if k != "shared_expert"}
    y, aux = fast_jit(module.apply)({"params": routed_params}, x)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), routed_params)
    tokens = np.asarray(x, np.float64).reshape(-1, D_MODEL)
    routes, _ = np_route(tokens @ p["router"], None, TOP_K)
    indices = np.array([sorted(r) for r in routes])
    combine = np.array([[r[e] for e in sorted(r)] for r in routes])
    ref_y, _ = np_routed_experts(tokens, indices, combine, p["gate_proj"], p["up_proj"],
                                 p["down_proj"], LIMIT)
    np.testing.assert_allclose(np.asarray(y), ref_y.reshape(x.shape), rtol=1e-4, atol=1e-5)
