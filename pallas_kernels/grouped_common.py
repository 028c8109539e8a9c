"""What the Mosaic (TPU) and Triton (GPU) grouped matmuls share: tile sizes by role, the visit
schedule of row tiles and groups, the interpret-mode default and the float32-accumulating dot.

The schedule is described in `pallas_kernels.grouped_matmul`'s docstring ("Tiling and
schedule"): rows sorted by group are cut into T = cdiv(M, tm) row tiles, and a tile that
straddles a group boundary is visited once per group it touches, so S = T + E - 1 visits always
suffice. It is computed with jnp from group_sizes on device; the TPU kernels read it as
scalar-prefetch operands, the GPU kernels as ordinary int32 arrays.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.target import target_backend


class Tiling(NamedTuple):
    """Tile sizes by role: rows (M), contraction (K) and output columns (N) of the forward gmm.

    The backward passes reuse them by role: dlhs = gmm(dout, rhs^T) contracts over N (tile
    `cols`) and produces K (tile `contract`); tgmm reduces over rows (tile `rows`).
    """

    rows: int
    contract: int
    cols: int


def resolve_interpret(interpret: bool | None) -> bool:
    return target_backend() == "cpu" if interpret is None else bool(interpret)


class Schedule(NamedTuple):
    """Visit list of a grouped matmul; arrays have the static length S = T + E - 1.

    Visit s works on row tile `visit_tile[s]` for group `visit_group[s]`, whose rows are
    [group_offsets[g], group_offsets[g + 1]). Group id E is the "null" group (rows past the last
    group; an empty range). Entries at s >= num_visits repeat the last visit and are not run.
    """

    visit_group: jax.Array  # [S] int32
    visit_tile: jax.Array  # [S] int32
    group_offsets: jax.Array  # [E + 2] int32: starts of groups 0..E-1, total, total
    num_visits: jax.Array  # [] int32


def schedule_size(num_rows: int, row_tile: int, num_groups: int) -> int:
    return pl.cdiv(num_rows, row_tile) + num_groups - 1


def make_schedule(group_sizes: jax.Array, num_rows: int, row_tile: int, *,
                  visit_empty_groups: bool) -> Schedule:
    """Visits for gmm (`visit_empty_groups=False`: every row tile at least once, empty groups
    never) or tgmm (`True`: every group at least once, row tiles without groups never)."""
    group_sizes = group_sizes.astype(jnp.int32)
    num_groups = group_sizes.shape[0]
    num_tiles = pl.cdiv(num_rows, row_tile)
    size = schedule_size(num_rows, row_tile, num_groups)

    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    total = ends[-1]
    nonempty = group_sizes > 0
    first_tile = jnp.minimum(starts // row_tile, num_tiles - 1)
    last_tile = jnp.where(nonempty, (ends - 1) // row_tile, first_tile)
    per_group = jnp.where(nonempty, last_tile - first_tile + 1, int(visit_empty_groups))
    group_visit_end = jnp.cumsum(per_group)
    group_visits = group_visit_end[-1]
    # gmm: tiles wholly past the last group get one null visit each (they must be zeroed).
    covered_tiles = (total + row_tile - 1) // row_tile
    null_visits = 0 if visit_empty_groups else num_tiles - covered_tiles
    num_visits = (group_visits + null_visits).astype(jnp.int32)

    s = jnp.minimum(jnp.arange(size, dtype=jnp.int32), num_visits - 1)
    group = jnp.searchsorted(group_visit_end, s, side="right").astype(jnp.int32)
    in_group = group < num_groups
    g = jnp.minimum(group, num_groups - 1)
    rank = s - (group_visit_end[g] - per_group[g])
    tile = jnp.where(in_group, first_tile[g] + rank, covered_tiles + s - group_visits)
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), ends, total[None]]).astype(jnp.int32)
    return Schedule(group, tile.astype(jnp.int32), offsets, num_visits)


def dot_f32(x: jax.Array, y: jax.Array, contract: tuple[tuple[int], tuple[int]], precision):
    """2-D matmul contracting the given axes of x and y, accumulated in float32."""
    return jax.lax.dot_general(x, y, (contract, ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def matmul_precision(dtype) -> jax.lax.Precision:
    """HIGHEST for float32 inputs (true float32 products: IEEE on Triton, no TF32), DEFAULT
    (one native pass) for bfloat16."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def gmm_shapes(lhs: jax.Array, rhs: jax.Array, transpose_rhs: bool, out_dtype):
    """(M, K, N, output dtype) of gmm(lhs [M, K], rhs [E, K, N], or [E, N, K] with
    transpose_rhs); refuses operands that disagree on K."""
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if rhs.shape[2 if transpose_rhs else 1] != k:
        raise ValueError(f"gmm: lhs {lhs.shape} and rhs {rhs.shape} disagree on K "
                         f"(transpose_rhs={transpose_rhs})")
    return m, k, n, jnp.dtype(out_dtype or jnp.result_type(lhs.dtype, rhs.dtype))


def tgmm_shapes(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype):
    """(M, K, N, E, output dtype) of tgmm(lhs [M, K], rhs [M, N], group_sizes [E]); refuses
    operands that disagree on M."""
    m, k = lhs.shape
    if rhs.shape[0] != m:
        raise ValueError(f"tgmm: lhs {lhs.shape} and rhs {rhs.shape} disagree on rows")
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs.dtype, rhs.dtype))
    return m, k, rhs.shape[1], group_sizes.shape[0], out_dtype
