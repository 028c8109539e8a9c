"""Routed-expert dispatch (sorted chunks and ragged_dot) and its gradients against per-token
float64 numpy references with explicit loops (tests/moe_references.py). The chunk loop and the
row permutation on their own: tests/model/test_moe_chunks.py."""

from __future__ import annotations

import functools
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_references import (
    fast_jit,
    np_routed_experts,
)

from model.layers.moe import routed_experts
from model.ops.moe_dispatch import ExpertWeights
from model.ops.swiglu import SwiGLUClamp

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


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
    return fast_jit(functools.partial(routed_experts, clamp=SwiGLUClamp(limit), impl=impl,
                                      block_size=block_size))


@pytest.mark.slow
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


@pytest.mark.slow
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
        fn = functools.partial(routed_experts, clamp=SwiGLUClamp(limit), impl=impl,
                               block_size=block_size)
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
