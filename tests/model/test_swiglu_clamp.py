"""The SwiGLU clamp in its two placements (model/ops/swiglu.py): Step 3.5 caps silu(gate) at L,
DeepSeek-V4 (report 4.2.3) caps the gate input before the SiLU; the linear part is clipped to
[-L, L] in both. Float64 numpy references with explicit loops and transformers' V4 modules."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.ops.swiglu import SwiGLUClamp, swiglu_activation

# gate inputs around the limit, where the placements differ (silu(10) = 9.99955)
GATE = np.array([[-12.0, -1.0, 0.5, 9.9, 10.0002, 10.3, 11.0, 40.0]], np.float32)
UP = np.array([[3.0, -14.0, 0.7, 12.0, -2.0, 10.5, -10.5, 1.0]], np.float32)


def np_swiglu(gate_pre, up_pre, limit, before_silu):
    out = np.zeros(gate_pre.shape)
    for idx in np.ndindex(gate_pre.shape):
        g, u = float(gate_pre[idx]), float(up_pre[idx])
        if limit > 0:
            u = min(max(u, -limit), limit)
            g = min(g, limit) if before_silu else g
        silu = g / (1 + math.exp(-g))
        out[idx] = (min(silu, limit) if limit > 0 and not before_silu else silu) * u
    return out


@pytest.mark.parametrize("gate_clamp", ["after_silu", "before_silu"])
@pytest.mark.parametrize("limit", [0.0, 10.0])
def test_swiglu_clamp_matches_reference(gate_clamp, limit):
    got = swiglu_activation(jnp.asarray(GATE), jnp.asarray(UP), SwiGLUClamp(limit, gate_clamp))
    expected = np_swiglu(GATE, UP, limit, gate_clamp == "before_silu")
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6)


def test_the_two_placements_differ_above_the_limit_in_value_and_gradient():
    after = swiglu_activation(jnp.asarray(GATE), jnp.asarray(UP), SwiGLUClamp(10.0))  # default
    before = swiglu_activation(jnp.asarray(GATE), jnp.asarray(UP),
                               SwiGLUClamp(10.0, "before_silu"))
    differs = np.asarray(after) != np.asarray(before)
    np.testing.assert_array_equal(differs[0], GATE[0] > 10.0)
    grad = jax.grad(lambda g, mode: jnp.sum(
        swiglu_activation(g, jnp.ones_like(g), SwiGLUClamp(10.0, mode))), argnums=0)
    g_after = np.asarray(grad(jnp.asarray(GATE), "after_silu"))[0]
    g_before = np.asarray(grad(jnp.asarray(GATE), "before_silu"))[0]
    assert g_after[4] > 0 and g_before[4] == 0  # x = 10.0002: silu(x) < 10, x > 10
    assert np.all(g_before[GATE[0] > 10] == 0) and np.all(g_before[GATE[0] < 10] != 0)


def test_unknown_gate_clamp_is_rejected():
    with pytest.raises(ValueError, match="gate_clamp"):
        swiglu_activation(jnp.ones(2), jnp.ones(2), SwiGLUClamp(10.0, "pre"))


@pytest.mark.parity
def test_before_silu_matches_transformers_v4_experts_and_shared_mlp():
    import torch
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4Experts,
        DeepseekV4MLP,
    )

    config = DeepseekV4Config(hidden_size=8, n_routed_experts=4, num_experts_per_tok=2,
                              vocab_size=16, moe_intermediate_size=8, num_hidden_layers=2)
    assert config.swiglu_limit == 10.0
    experts = DeepseekV4Experts(config)
    gate_up = torch.from_numpy(np.concatenate([GATE, UP], axis=-1))
    np.testing.assert_allclose(
        np.asarray(swiglu_activation(jnp.asarray(GATE), jnp.asarray(UP),
                                     SwiGLUClamp(10.0, "before_silu"))),
        experts._apply_gate(gate_up).numpy(), rtol=1e-6)

    torch.manual_seed(0)
    mlp = DeepseekV4MLP(config)  # the shared expert clamps the same way
    x = 12.0 * torch.randn(5, 8)
    with torch.no_grad():
        expected = mlp(x).numpy()
    wg, wu, wd = (jnp.asarray(p.weight.detach().numpy()).T
                  for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    xj = jnp.asarray(x.numpy())
    assert float(jnp.max(xj @ wg)) > 10.0  # the clamp is exercised
    got = swiglu_activation(xj @ wg, xj @ wu, SwiGLUClamp(10.0, "before_silu")) @ wd
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)
