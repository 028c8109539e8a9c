"""The `MoE` module (router, routed and shared experts, the SwiGLU clamps, aux statistics and
the eq. 1 balance loss formed from them) against the float64 numpy references of
tests/moe_references.py (docs/architecture.md, "Exact semantics"; report eq. 1 and 4.1.3)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_references import (
    fast_jit,
    np_ep_balance_loss,
    np_route,
    np_routed_experts,
    np_routed_experts_grads,
    np_sigmoid,
    np_swiglu,
)

from model.config import QATConfig, load_config
from model.layers.moe import MoE
from model.lm import collect_aux

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


IMPLS = ["sorted", "ragged_dot"]
REPLAY_IMPLS = [*IMPLS, "pallas"]  # pallas: the grouped-matmul kernels in interpret mode


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


def _np_moe(params, bias, x, before_silu=False):
    """Reference MoE output and aux from the module's params, in float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    tokens = np.asarray(x, np.float64).reshape(-1, D_MODEL)
    routes, probs = np_route(tokens @ p["router"], bias, TOP_K)
    indices = np.array([sorted(r) for r in routes])
    combine = np.array([[r[e] for e in sorted(r)] for r in routes])
    y, stats = np_routed_experts(tokens, indices, combine, p["gate_proj"], p["up_proj"],
                                 p["down_proj"], LIMIT, before_silu)
    shared = p["shared_expert"]
    shared_out, _ = np_swiglu(tokens, shared["gate_proj"]["kernel"], shared["up_proj"]["kernel"],
                              shared["down_proj"]["kernel"], SHARED_LIMIT, before_silu)
    load = stats["expert_tokens"] / indices.size
    # DeepSeek-V4's sequence-wise balance loss: per row sum_i f_i P_i with
    # f_i = E / (k T) * (times i is chosen in the row), P_i = the row's mean probability
    batch, length = x.shape[:2]
    per_row = []
    for b in range(batch):
        rows = range(b * length, (b + 1) * length)
        f = np.zeros(EXPERTS)
        for n in rows:
            for e in routes[n]:
                f[e] += EXPERTS / (TOP_K * length)
        per_row.append(np.sum(f * probs[list(rows)].mean(0)))
    aux = {
        "expert_load": load,
        "expert_prob": probs.mean(0),
        "routed_experts": np.array([list(r) for r in routes]),  # by descending selection score
        "routing_confidence": np.array([sum(probs[n, e] for e in r) for n, r in enumerate(routes)]),
        "sequence_balance_loss": np.mean(per_row),
        **stats,
    }
    return (y + shared_out).reshape(x.shape), aux, routes


def test_collect_aux_sums_the_balance_losses_over_learned_layers(moe_setup):
    """Eq. 1 per layer from the layer aux, and both balance losses summed over the MoE layers
    (DeepSeek's per-layer AddAuxiliaryLoss), hash-routed layers left out. Layer n's
    probabilities are scaled by n + 1 (both losses are linear in them), so a mean or a wrong
    exclusion gives another number."""
    _, x, params, _ = moe_setup
    cfg = _module_cfg("sorted").replace(gate="none")
    _, aux = _apply(cfg, params, jnp.zeros(EXPERTS), x)
    ref = np_ep_balance_loss(np.asarray(aux["expert_load"], np.float64),
                             np.asarray(aux["expert_prob"], np.float64), GROUPS)
    assert GROUPS == cfg.moe.num_ep_groups
    moe_layers = cfg.moe_layer_indices()
    assert len(moe_layers) >= 3
    per_layer = [{} for _ in range(cfg.num_layers)]
    for n, i in enumerate(moe_layers):
        per_layer[i] = {**aux, "expert_prob": (n + 1) * aux["expert_prob"],
                        "sequence_balance_loss": (n + 1) * aux["sequence_balance_loss"]}
    for hash_layers in (0, 2):
        hashed = cfg.replace(moe=dataclasses.replace(cfg.moe, hash_layers=hash_layers))
        collected = collect_aux(hashed, per_layer)
        np.testing.assert_allclose(np.asarray(collected["moe"]["balance_loss"]),
                                   ref * np.arange(1, len(moe_layers) + 1), rtol=1e-5)
        learned = sum(n + 1 for n in range(hash_layers, len(moe_layers)))
        np.testing.assert_allclose(float(collected["balance_loss"]), learned * ref, rtol=1e-5)
        np.testing.assert_allclose(float(collected["sequence_balance_loss"]),
                                   learned * float(aux["sequence_balance_loss"]), rtol=1e-5)


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
    expected_shapes.update(routing_confidence=x.shape[:2], sequence_balance_loss=(),
                           routed_experts=(*x.shape[:2], TOP_K))
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


def test_moe_module_caps_gates_before_the_silu_when_configured(moe_setup):
    """swiglu_gate_clamp=before_silu (DeepSeek-V4) reaches the routed and the shared experts."""
    cfg, x, params, _ = moe_setup
    module = MoE(cfg.replace(swiglu_gate_clamp="before_silu"), LIMIT, SHARED_LIMIT)
    bias = np.zeros(EXPERTS, np.float32)
    y, _ = fast_jit(module.apply)({"params": params, "balance": {"router_bias": bias}}, x)
    ref_y, _, _ = _np_moe(params, bias, x, before_silu=True)
    np.testing.assert_allclose(np.asarray(y), ref_y, rtol=1e-4, atol=1e-5)
    assert not np.allclose(_np_moe(params, bias, x)[0], ref_y, atol=1e-2)  # placement matters


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
    """The router runs in float32 whatever the compute dtype (docs/architecture.md, "Exact
    semantics"). With bf16 compute the routing probabilities must still agree with a float64
    reference to float32 precision (a bf16 router would be off by ~1e-3)."""
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


# ---- replayed routing (model/layers/router.py, "Replayed routing") -----------------------------


def _replay_case(x):
    """Replayed experts [B, T, k]: k distinct random experts per token, and tokens 0 and 5 of
    the first row unrecorded (-1: they keep the router's own choice)."""
    rng = np.random.default_rng(12)
    chosen = np.stack([rng.choice(EXPERTS, TOP_K, replace=False)
                       for _ in range(x.shape[0] * x.shape[1])]).reshape(*x.shape[:2], TOP_K)
    chosen[0, [0, 5]] = -1
    return chosen.astype(np.int32)


def _np_replayed(params, x, replayed, probe):
    """Float64 reference of the MoE with replayed experts -> (y [N, D], experts used [N, k],
    d sum(y * probe) / d router [D, E]). The combine weights are the current router's scores
    at the replayed experts, renormalised and scaled (3.0); the router gets its gradient
    through them: dc_j/dz_m = 3 s'_m (1[j = m] S - s_j) / S^2, with s = sigmoid(z), s' its
    slope and S the sum of the k scores."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    tokens = np.asarray(x, np.float64).reshape(-1, D_MODEL)
    logits = tokens @ p["router"]
    own, _ = np_route(logits, None, TOP_K)  # the bias (zero here) only selects
    flat = replayed.reshape(-1, TOP_K)
    used = np.array([row if row.min() >= 0 else list(mine) for row, mine in zip(flat, own)])
    scores = np_sigmoid(logits)
    chosen = np.take_along_axis(scores, used, axis=1)
    total = chosen.sum(1, keepdims=True)
    combine = 3.0 * chosen / total
    y, _ = np_routed_experts(tokens, used, combine, p["gate_proj"], p["up_proj"],
                             p["down_proj"], LIMIT)
    shared = p["shared_expert"]
    y = y + np_swiglu(tokens, shared["gate_proj"]["kernel"], shared["up_proj"]["kernel"],
                      shared["down_proj"]["kernel"], SHARED_LIMIT)[0]
    probe = np.asarray(probe, np.float64).reshape(-1, D_MODEL)
    _, d_combine, *_ = np_routed_experts_grads(tokens, used, combine, p["gate_proj"],
                                               p["up_proj"], p["down_proj"], probe, LIMIT, False)
    slope = np.take_along_axis(scores * (1 - scores), used, axis=1)
    d_chosen = 3.0 * slope * (d_combine * total - np.sum(d_combine * chosen, 1, keepdims=True)) \
        / total ** 2
    d_logits = np.zeros_like(logits)
    np.put_along_axis(d_logits, used, d_chosen, axis=1)
    return y, used, tokens.T @ d_logits


@pytest.mark.parametrize("impl", REPLAY_IMPLS)
def test_replayed_experts_take_the_current_routers_weights(moe_setup, impl):
    """Tokens go to the replayed experts with the current router's (renormalised, scaled)
    scores of those experts, the router gets its gradient through those weights, unrecorded
    tokens keep their own choice, and `replay_mismatch` marks the recorded tokens whose own
    top-k differs. Every moe_impl: the replayed choice enters the same dispatch."""
    _, x, params, _ = moe_setup
    module = MoE(_module_cfg(impl), LIMIT, SHARED_LIMIT)
    bias = {"router_bias": jnp.zeros(EXPERTS)}
    replayed = _replay_case(x)
    probe = jnp.asarray(np.random.default_rng(13).normal(size=x.shape), jnp.float32)

    def probed(router):
        y, aux = module.apply({"params": {**params, "router": router}, "balance": bias}, x,
                              None, jnp.asarray(replayed))
        return jnp.sum(y * probe), (y, aux)

    grad, (y, aux) = fast_jit(jax.grad(probed, has_aux=True))(params["router"])
    ref_y, used, ref_grad = _np_replayed(params, x, replayed, probe)
    np.testing.assert_allclose(np.asarray(y).reshape(ref_y.shape), ref_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-4, atol=1e-6)
    assert np.abs(ref_grad).max() > 1e-2  # a real gradient reaches the router
    np.testing.assert_array_equal(np.asarray(aux["routed_experts"]).reshape(used.shape), used)
    own = _np_moe(params, np.zeros(EXPERTS), x)[2]
    recorded = replayed.reshape(-1, TOP_K).min(1) >= 0
    expected = [rec and set(mine) != set(row) for rec, mine, row in
                zip(recorded, own, replayed.reshape(-1, TOP_K))]
    np.testing.assert_array_equal(np.asarray(aux["replay_mismatch"]).reshape(-1), expected)
    assert 0 < np.mean(expected) < 1


@pytest.mark.slow
def test_expert_qat_computes_with_the_quantized_weights_and_passes_their_gradient():
    """`qat.expert_weights: mxfp4`: outputs and gradients at the float32 masters equal the plain
    module's at the weights' MXFP4 values (the straight-through estimator), the router's too."""
    from test_mx_quant import mxfp4_values

    cfg = _module_cfg()
    x = jax.random.normal(jax.random.key(5), (2, 6, D_MODEL))
    variables = nn.meta.unbox(MoE(cfg).init(jax.random.key(6), x))
    names = ("gate_proj", "up_proj", "down_proj")
    rounded = {**variables["params"], **{  # each expert's [in, out] as MXFP4 rows of [out, in]
        n: mxfp4_values(np.asarray(variables["params"][n]).swapaxes(-1, -2)).swapaxes(-1, -2)
        .astype(np.float32) for n in names}}

    def loss_and_grads(config, params):
        def loss(p):
            y, aux = MoE(config).apply({**variables, "params": p}, x)
            return jnp.sum(y * y) + aux["sequence_balance_loss"]
        return jax.jit(jax.value_and_grad(loss))(params)

    qat = cfg.replace(qat=QATConfig(expert_weights="mxfp4"))
    value, grads = loss_and_grads(qat, variables["params"])
    want_value, want_grads = loss_and_grads(cfg, rounded)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    for name in (*names, "router"):
        np.testing.assert_allclose(grads[name], want_grads[name], rtol=1e-5, atol=1e-7)
    assert not np.allclose(rounded["gate_proj"], variables["params"]["gate_proj"])
