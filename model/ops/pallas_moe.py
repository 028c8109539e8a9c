"""`moe_impl=pallas`: routed experts on the Pallas grouped matmuls (docs/architecture.md,
"Implementation tables").

    permute          token copies -> rows sorted (stably) by expert, plus group sizes
    gmm x3           gate / up projections, SwiGLU with the report's clamp (4.1.3), down
    unpermute        rows back to [N, k, D] token-copy order
    (combine)        `unpermute_combine` also applies the router weights -> [N, D]

`pallas_moe_ffn` has the `moe_impl` signature (`model.ops.tables`) and returns what `sorted` and
`ragged_dot` return: per-copy outputs [N, k, D] and the per-expert statistics. The permutes are
XLA gathers (their gradients are scatter-adds); only the expert matmuls are Pallas kernels: Mosaic
on TPU, Triton on GPU (`pallas_kernels.grouped_matmul.resolve_kernel`; see the kernel modules for
what lowers where and what was verified).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from model.ops.moe_dispatch import (
    ExpertWeights,
    SortedCopies,
    combine_copies,
    expert_statistic_sums,
    sort_copies,
)
from model.ops.swiglu import SwiGLUClamp, swiglu_activation
from pallas_kernels import grouped_matmul_triton
from pallas_kernels.grouped_common import Tiling, resolve_interpret
from pallas_kernels.grouped_matmul import default_tiling, gmm, resolve_kernel


def permute(x: jax.Array, indices: jax.Array, num_experts: int) -> tuple[jax.Array, SortedCopies]:
    """x [N, D], indices [N, k] -> (rows [N*k, D] grouped by expert, the sort).

    Row i is token `order[i] // k`; rows of expert e are contiguous, `group_sizes[e]` of them,
    in token order (stable sort), starting at `cumsum(group_sizes)[e] - group_sizes[e]`.
    """
    copies = sort_copies(indices, num_experts)
    return x[copies.order // indices.shape[1]], copies


def unpermute(rows: jax.Array, copies: SortedCopies, top_k: int) -> jax.Array:
    """rows [N*k, D] in expert order -> [N, k, D] in token-copy order (a gather)."""
    num_rows = rows.shape[0]
    position = jnp.zeros((num_rows,), jnp.int32).at[copies.order].set(
        jnp.arange(num_rows, dtype=jnp.int32))  # sorted position of each copy
    return rows[position].reshape(num_rows // top_k, top_k, rows.shape[-1])


def unpermute_combine(rows: jax.Array, copies: SortedCopies, combine_weights: jax.Array,
                      out_dtype=None) -> jax.Array:
    """rows [N*k, D] in expert order, combine_weights [N, k] -> sum_j w[n, j] * copy[n, j], [N, D].

    Accumulated in float32 (like `model.layers.moe.routed_experts`).
    """
    per_copy = unpermute(rows, copies, combine_weights.shape[1])
    return combine_copies(per_copy, combine_weights.astype(jnp.float32), out_dtype or rows.dtype)


def moe_tiling(kernel: str, block_size: int, interpret: bool) -> Tiling:
    """The grouped matmuls' tiles for `moe.block_size` rows: the kernel's default contract/cols
    tiles, and block_size rows, rounded up where compiled kernels need it (Mosaic: a multiple of
    8, the sublane count; Triton: a power of two >= 16, its tensor-shape rule)."""
    if kernel == "triton":
        tiles = grouped_matmul_triton.default_tiling(interpret)
        rows = max(grouped_matmul_triton.MIN_TILE, pl.next_power_of_2(block_size))
    else:
        tiles = default_tiling(interpret)
        rows = -(-block_size // 8) * 8
    return tiles._replace(rows=block_size if interpret else rows)


def pallas_moe_ffn(x, indices, weights: ExpertWeights, clamp: SwiGLUClamp, block_size, *,
                   tiling: Tiling | tuple[int, int, int] | None = None,
                   interpret: bool | None = None, kernel: str | None = None):
    """x [N, D], indices [N, k] -> (per-copy expert outputs [N, k, D], per-expert statistic
    sums of [E]; see `model.ops.moe_dispatch`). Copies of "no expert" (id E) give zero rows.

    block_size is the row tile of the grouped matmuls (`moe_tiling`); `tiling`, if given,
    overrides all tiles (rows, contract, cols). `interpret=None`: interpret mode on CPU.
    kernel: "mosaic" (TPU), "triton" (GPU) or None for the backend's.
    """
    num_experts = weights.gate.shape[0]
    top_k = indices.shape[1]
    kernel = resolve_kernel(kernel)
    if tiling is None:
        interpret = resolve_interpret(interpret)
        tiling = moe_tiling(kernel, block_size, interpret)
    rows, copies = permute(x, indices, num_experts)
    sizes = copies.group_sizes

    def grouped(lhs, rhs):
        return gmm(lhs, rhs, sizes, tiling=tiling, interpret=interpret, kernel=kernel)

    h = swiglu_activation(grouped(rows, weights.gate), grouped(rows, weights.up), clamp)
    out = jnp.where((copies.row_expert < num_experts)[:, None], grouped(h, weights.down), 0)
    h_sq = jnp.sum(jnp.square(h.astype(jnp.float32)), axis=-1)
    sums = expert_statistic_sums(out, h_sq, copies.row_expert, sizes)
    return unpermute(out, copies, top_k), sums
