"""The pieces of the `sorted` MoE path on their own, in float64: the row permutation's custom VJP
(gathers both ways) against JAX's gradient of a plain gather, and the per-expert chunk loop
(`model.ops.grouped_swiglu`) and its custom VJP against a per-row reference, with chunks that
overflow into the next expert, experts without rows and rows that belong to no expert."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_references import fast_jit

from model.ops.grouped_swiglu import MIN_CHUNK, chunk_sizes, grouped_swiglu
from model.ops.permute import permute_rows
from model.ops.swiglu import SwiGLUClamp, swiglu_activation


def test_chunk_sizes_halve_from_the_largest_useful_chunk():
    for max_chunk in (1, 4, 8, 16, 100, 256):
        for rows in (0, 1, 7, 8, 9, 100, 4096):
            sizes = chunk_sizes(rows, max_chunk)
            largest = max(min(max_chunk, 1 << max(rows - 1, 0).bit_length()), 1)
            assert sizes[0] == largest and largest >= min(rows, max_chunk)
            assert all(small == big // 2 for big, small in itertools.pairwise(sizes))
            assert sizes[-1] >= min(MIN_CHUNK, largest) > sizes[-1] // 2


def _one_to_one_map(rng, num_sources, copies_per_source, num_rows):
    """A random partial one-to-one map between rows and (source, copy) slots: (source [R], inverse
    [S, g]), out-of-range entries marking empty rows and copies without a row."""
    slots = rng.permutation(num_sources * copies_per_source)[: num_rows - 3]  # 3 rows stay empty
    rows = rng.permutation(num_rows)[: slots.size]
    source = np.full(num_rows, num_sources)
    source[rows] = slots // copies_per_source
    inverse = np.full(num_sources * copies_per_source, num_rows + 5)
    inverse[slots] = rows
    return source, inverse.reshape(num_sources, copies_per_source)


def test_permute_rows_gradient_is_the_gather_gradient():
    rng = np.random.default_rng(0)
    source, inverse = _one_to_one_map(rng, num_sources=6, copies_per_source=3, num_rows=14)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.normal(size=(6, 5)))
        probe = jnp.asarray(rng.normal(size=(14, 5)))

        def plain(x):  # JAX's own gradient: a scatter-add
            return jnp.sum(x.at[source].get(mode="fill", fill_value=0) * probe)

        def custom(x):
            return jnp.sum(permute_rows(x, jnp.asarray(source), jnp.asarray(inverse)) * probe)

        np.testing.assert_allclose(custom(x), plain(x), rtol=1e-12)
        np.testing.assert_allclose(jax.grad(custom)(x), jax.grad(plain)(x), rtol=1e-12)


def _reference_swiglu(rows, gate, up, down, row_expert, limit):
    """Per-row SwiGLU with the row's expert; rows of expert id E give zeros."""
    num_experts = gate.shape[0]
    outs, h_sq = [], []
    for r in range(rows.shape[0]):
        e = int(row_expert[r])
        if e >= num_experts:
            outs.append(jnp.zeros(rows.shape[1], rows.dtype))
            h_sq.append(jnp.zeros((), rows.dtype))
            continue
        h = swiglu_activation(rows[r] @ gate[e], rows[r] @ up[e], SwiGLUClamp(limit))
        outs.append(h @ down[e])
        h_sq.append(jnp.sum(h * h))
    return jnp.stack(outs), jnp.stack(h_sq)


# counts per expert (chunk sizes 32, 16, 8 when max_chunk is 32): zero rows, a 37-row expert
# (32 + an 8-chunk overflowing 3 rows), 9 rows (a 16-chunk overflowing 7 rows into the next
# experts), exact chunk fits, and a last expert next to the "no expert" rows.
COUNTS = {"mixed": [0, 3, 37, 9, 1, 16, 0], "single_chunk_size": [5, 0, 12, 2]}


@pytest.mark.parametrize("name,max_chunk,limit", [("mixed", 32, 0.0), ("mixed", 32, 0.4),
                                                  ("single_chunk_size", 4, 0.0)])
@pytest.mark.slow
def test_grouped_swiglu_matches_per_row_reference(name, max_chunk, limit):
    counts = np.asarray(COUNTS[name])
    num_experts, d_model, hidden, unrouted = counts.size, 6, 5, 4
    sizes = chunk_sizes(int(counts.sum()), max_chunk)
    row_expert = np.concatenate([np.repeat(np.arange(num_experts), counts),
                                 np.full(unrouted + sizes[0], num_experts)])
    starts = jnp.asarray(np.cumsum(counts) - counts, jnp.int32)
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        rows = jnp.asarray(rng.normal(size=(row_expert.size, d_model)))
        weights = tuple(jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[1])) for shape in
                        [(num_experts, d_model, hidden)] * 2 + [(num_experts, hidden, d_model)])
        probe = jnp.asarray(rng.normal(size=rows.shape))  # nonzero on rows of no expert too
        owned = jnp.asarray(row_expert < num_experts)[:, None]

        def loss(fn, rows, *weights):
            out, h_sq, *out_sq = fn(rows, *weights)
            return jnp.sum(jnp.where(owned, out, 0) * probe), (out, h_sq, out_sq)

        def chunked(rows, *weights):
            return grouped_swiglu(rows, *weights, starts, jnp.asarray(counts, jnp.int32),
                                  SwiGLUClamp(limit),
                                  sizes)

        def reference(rows, *weights):
            return _reference_swiglu(rows, *weights, row_expert, limit)

        results = {}
        for label, fn in (("chunked", chunked), ("reference", reference)):
            step = jax.value_and_grad(lambda *a, fn=fn: loss(fn, *a), argnums=(0, 1, 2, 3),
                                      has_aux=True)
            results[label] = fast_jit(step)(rows, *weights)
        (_, (out, h_sq, (out_sq,))), grads = results["chunked"]
        (_, (ref_out, ref_h_sq, _)), ref_grads = results["reference"]
        mask = row_expert < num_experts
        np.testing.assert_allclose(out[mask], ref_out[mask], rtol=1e-10, atol=1e-12)
        assert h_sq.dtype == out_sq.dtype == jnp.float32  # statistics are kept in float32
        np.testing.assert_allclose(h_sq[mask], ref_h_sq[mask], rtol=1e-6)
        ref_out_sq = np.sum(np.square(np.asarray(ref_out, np.float64)), axis=-1)
        np.testing.assert_allclose(out_sq[mask], ref_out_sq[mask], rtol=1e-6)
        for label, got, want in zip(["rows", "gate", "up", "down"], grads, ref_grads):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=label)
        # experts without rows get exactly zero weight gradient
        for got in grads[1:]:
            assert np.all(np.asarray(got)[counts == 0] == 0)
