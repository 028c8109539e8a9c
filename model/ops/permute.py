"""Row permutations of the MoE dispatch as gathers in both directions (custom VJP).

The routed copies of the tokens are moved into expert order and back. Each destination row holds
at most one copy and each copy sits in at most one row, so the transpose of such a gather is again
a gather (by the inverse map) followed by a sum over the copies of one source row. JAX's own
gradient of a gather is a scatter-add, which XLA:CPU runs serially and which was a large part of
the `sorted` path's backward pass.
"""

from __future__ import annotations

import jax


def _gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [S, D], index [R] -> [R, D]; row r is x[index[r]], or zeros where index[r] >= S."""
    with jax.named_scope("dispatch"):  # profile attribution (benchmarks/gpu/profiling.py)
        return x.at[index].get(mode="fill", fill_value=0)


@jax.custom_vjp
def permute_rows(x: jax.Array, source: jax.Array, inverse: jax.Array) -> jax.Array:
    """x [S, D], source [R] int, inverse [S, g] int -> rows [R, D] with rows[r] = x[source[r]].

    `source[r] >= S` marks an empty row (zeros). `inverse[s, j]` is the row holding the j-th copy
    of x row s, or >= R if that copy has no row. The two must describe the same one-to-one map
    between rows and copies; the gradient relies on it: dx[s] = sum_j drows[inverse[s, j]].
    """
    return _gather_rows(x, source)


def _permute_rows_fwd(x, source, inverse):
    return _gather_rows(x, source), inverse


def _permute_rows_bwd(inverse, d_rows):
    num_sources, copies_per_source = inverse.shape
    d_copies = _gather_rows(d_rows, inverse.reshape(-1))
    d_x = d_copies.reshape(num_sources, copies_per_source, -1).sum(axis=1)
    return d_x, None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)
