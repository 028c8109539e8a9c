"""Independent float64 numpy references of the router, SwiGLU and routed experts (explicit
loops; docs/architecture.md "Exact semantics", report eq. 1 and 4.1.3), routing comparisons
and a fast-compiling jit, shared by tests/model/test_moe_router.py, test_moe_routed_experts.py and test_moe_module.py;
grouped-matmul operands, float64 loops and the relative error for the Pallas kernel tests
(tests/pallas_kernels/test_pallas_moe*.py, test_grouped_matmul_mgpu.py).
Nothing here imports `model/`."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np

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


def np_swiglu(x, w_gate, w_up, w_down, limit, before_silu=False):
    """SwiGLU with the clamp (limit > 0): the gate capped at the limit after the SiLU, or its
    input capped before it (before_silu, DeepSeek-V4); the up projection clipped to +-limit."""
    gate_pre, up = x @ w_gate, x @ w_up
    if limit > 0 and before_silu:
        gate_pre = np.minimum(gate_pre, limit)
    gate = gate_pre * np_sigmoid(gate_pre)  # silu
    if limit > 0:
        gate = gate if before_silu else np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
    h = gate * up
    return h @ w_down, h


def np_routed_experts(x, indices, combine, wg, wu, wd, limit, before_silu=False):
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
            out, h = np_swiglu(x[t], wg[e], wu[e], wd[e], limit, before_silu)
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


def np_routed_experts_grads(x, indices, combine, wg, wu, wd, probe, limit, before_silu):
    """Gradients of sum(y * probe), y of `np_routed_experts`, with respect to (x, combine, wg,
    wu, wd): the SwiGLU backward written out copy by copy. A capped or clipped input gets no
    gradient."""
    x, combine, probe = (np.asarray(a, np.float64) for a in (x, combine, probe))
    wg, wu, wd = (np.asarray(w, np.float64) for w in (wg, wu, wd))
    d_x, d_combine = np.zeros_like(x), np.zeros_like(combine)
    d_wg, d_wu, d_wd = np.zeros_like(wg), np.zeros_like(wu), np.zeros_like(wd)
    clamped = limit > 0
    for t in range(indices.shape[0]):
        for j in range(indices.shape[1]):
            e = int(indices[t, j])
            g, u = x[t] @ wg[e], x[t] @ wu[e]
            z = np.minimum(g, limit) if clamped and before_silu else g
            sig = np_sigmoid(z)
            silu, silu_slope = z * sig, sig * (1 + z * (1 - sig))
            gate = np.minimum(silu, limit) if clamped and not before_silu else silu
            gate_open = (g < limit if before_silu else silu < limit) if clamped else True
            up = np.clip(u, -limit, limit) if clamped else u
            up_open = np.abs(u) < limit if clamped else True
            h = gate * up
            d_out = combine[t, j] * probe[t]
            d_combine[t, j] = (h @ wd[e]) @ probe[t]
            d_wd[e] += np.outer(h, d_out)
            d_h = wd[e] @ d_out
            d_g = d_h * up * silu_slope * gate_open
            d_u = d_h * gate * up_open
            d_wg[e] += np.outer(x[t], d_g)
            d_wu[e] += np.outer(x[t], d_u)
            d_x[t] += wg[e] @ d_g + wu[e] @ d_u
    return d_x, d_combine, d_wg, d_wu, d_wd


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


# ---- grouped matmul operands ------------------------------------------------------------------


def grouped_matmul_operands(name: str, case: tuple, dtype):
    """(lhs [M, K], rhs [E, K, N], group_sizes [E] int32, dout [M, N]) for a case
    (group sizes, M, K, N), drawn from a generator seeded by the case's name."""
    sizes, m, k, n = case
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), k, n)) / np.sqrt(k), dtype)
    dout = jnp.asarray(rng.normal(size=(m, n)), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), dout


def numpy_grouped(lhs, rhs, dout, sizes):
    """(out, dlhs, drhs) in float64 by explicit loops over groups and their rows."""
    lhs, rhs, dout = (as_float64(a) for a in (lhs, rhs, dout))
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    dlhs = np.zeros(lhs.shape)
    drhs = np.zeros(rhs.shape)
    start = 0
    for g, size in enumerate(sizes):
        for r in range(start, start + size):
            for j in range(rhs.shape[2]):
                out[r, j] = sum(lhs[r, c] * rhs[g, c, j] for c in range(lhs.shape[1]))
            dlhs[r] = rhs[g] @ dout[r]
            drhs[g] += np.outer(lhs[r], dout[r])
        start += size
    return out, dlhs, drhs


def as_float64(a) -> np.ndarray:
    """A float64 numpy copy (numpy arrays keep their precision; JAX arrays go through float32)."""
    return np.asarray(a if isinstance(a, np.ndarray) else jnp.asarray(a, jnp.float32), np.float64)


def rel_error(actual, expected) -> float:
    """max|actual - expected| / max|expected|, in float64."""
    actual, expected = as_float64(actual), as_float64(expected)
    assert actual.shape == expected.shape
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))
