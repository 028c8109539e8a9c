"""`swiglu_gate_clamp` on every SwiGLU path: each `moe_impl` (pallas in interpret mode on CPU)
and the dense FFN, with the DeepSeek-V4 placement silu(min(x W_g, L)) * clip(x W_u, -L, L),
against the float64 numpy references of tests/moe_references.py (values, and gradients through
the `sorted` custom VJP and `ragged_dot`). The MoE module's wiring:
tests/model/test_moe_module.py."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_references import fast_jit, np_routed_experts, np_routed_experts_grads, np_swiglu

from model.config import load_config
from model.layers.ffn import SwiGLU
from model.layers.moe import routed_experts
from model.ops.moe_dispatch import ExpertWeights
from model.ops.swiglu import SwiGLUClamp

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
LIMIT = 1.0  # small against gate inputs of scale 2, so the cap binds on many of them


def _case():
    """(x [12, 4], indices [12, 2], combine, ExpertWeights [3 experts, hidden 6], probe)."""
    rng = np.random.default_rng(21)
    n, d, e, k, f = 12, 4, 3, 2, 6
    x = (2.0 * rng.normal(size=(n, d))).astype(np.float32)
    idx = np.stack([rng.choice(e, size=k, replace=False) for _ in range(n)]).astype(np.int32)
    combine = rng.uniform(0.2, 1.5, size=(n, k)).astype(np.float32)
    weights = ExpertWeights(*(
        (rng.normal(size=shape) / np.sqrt(shape[1])).astype(np.float32)
        for shape in [(e, d, f), (e, d, f), (e, f, d)]))
    probe = rng.normal(size=(n, d)).astype(np.float32)
    return x, idx, combine, weights, probe


def test_case_has_gate_inputs_above_the_limit_where_the_placements_differ():
    x, idx, combine, w, _ = _case()
    gate_pre = np.einsum("nd,edf->nef", x.astype(np.float64), w.gate)
    assert np.mean(gate_pre > LIMIT) > 0.2
    before, _ = np_routed_experts(x, idx, combine, *w, LIMIT, before_silu=True)
    after, _ = np_routed_experts(x, idx, combine, *w, LIMIT, before_silu=False)
    assert np.max(np.abs(before - after)) > 0.1 * np.max(np.abs(before))


@functools.lru_cache(maxsize=None)
def _loss_and_grads(impl, gate):
    def loss(x, combine, w, idx, probe):
        y, _ = routed_experts(x, idx, combine, w, clamp=SwiGLUClamp(LIMIT, gate), impl=impl,
                              block_size=8)
        return jnp.sum(y * probe), y
    return fast_jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("impl", ["sorted", "ragged_dot", "pallas"])
def test_routed_experts_cap_the_gate_before_the_silu(impl):
    x, idx, combine, w, probe = _case()
    (_, y), _ = _loss_and_grads(impl, "before_silu")(x, combine, w, idx, probe)
    want, _ = np_routed_experts(x, idx, combine, *w, LIMIT, before_silu=True)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl,gate", [("sorted", "before_silu"), ("ragged_dot", "before_silu"),
                                       ("sorted", "after_silu")])
def test_routed_expert_gradients_match_the_hand_written_backward(impl, gate):
    x, idx, combine, w, probe = _case()
    _, grads = _loss_and_grads(impl, gate)(x, combine, w, idx, probe)
    want = np_routed_experts_grads(x, idx, combine, *w, probe, LIMIT, gate == "before_silu")
    for label, got, ref in zip(["x", "combine", "gate", "up", "down"],
                               jax.tree.leaves(grads), want):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(),
                                   err_msg=f"d{label}")


def test_dense_ffn_caps_the_gate_before_the_silu():
    x, _, _, w, _ = _case()
    cfg = load_config(TINY, overrides=["swiglu_gate_clamp=before_silu"])
    module = SwiGLU(cfg, hidden=w.gate.shape[-1], limit=LIMIT)
    params = {name: {"kernel": jnp.asarray(kernel[0])}
              for name, kernel in zip(["gate_proj", "up_proj", "down_proj"], w)}
    got = fast_jit(module.apply)({"params": params}, jnp.asarray(x)[None])[0]
    want, _ = np_swiglu(x.astype(np.float64), *(np.asarray(k[0], np.float64) for k in w), LIMIT,
                        before_silu=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
