"""Grouped matmuls for MoE expert dispatch: `gmm` and its transpose `tgmm` in Pallas.

    gmm(lhs [M, K], rhs [E, K, N], group_sizes [E]) -> [M, N]
        rows of lhs are sorted by group; row r of group g gives lhs[r] @ rhs[g].
    tgmm(lhs [M, K], rhs [M, N], group_sizes [E]) -> [E, K, N]
        out[g] = lhs[rows of g].T @ rhs[rows of g]  (the weight gradient; 0 for an empty group).

`gmm` is differentiable (`jax.custom_vjp`): dlhs = gmm(dout, rhs transposed), drhs =
tgmm(lhs, dout). Rows beyond sum(group_sizes) belong to no group: their gmm output is 0 and they
add nothing to tgmm. sum(group_sizes) must not exceed M.

Tiling and schedule. Rows are cut into T = cdiv(M, tm) row tiles. A tile that straddles a group
boundary is visited once per group it touches, each visit computing the full tile against that
group's weights and keeping only its rows (row masking), so every visit is one dense
[tm, tk] x [tk, tn] matmul. Visits are listed group-major, which for contiguous groups is also
tile-major, in a schedule of static size S = T + E - 1: the first non-empty group starts at row 0,
and each later one adds at most one extra visit (its first tile may be shared). The schedule
(`pallas_kernels.grouped_common.make_schedule`) is computed with jnp from group_sizes on device
and handed to the kernel as scalar-prefetch operands (SMEM on TPU), which the BlockSpec index
maps read to pick each step's lhs tile and expert weights. The grid's visit axis has the dynamic
length `num_visits` <= S, so no step is spent on padding entries.

- gmm: grid (N tiles, visits, K tiles), K innermost with an f32 accumulator. At the last K step
  the tile's rows of this group are stored; the first visit to a row tile also zeroes the rest of
  the tile, so every output element is written even when rows belong to no group. The visit
  order keeps each output tile resident across its consecutive visits. A tile with no group rows
  gets one "null" visit that only writes zeros; empty groups get no visit at all.
- tgmm: grid (K tiles, N tiles, visits), visits innermost. The accumulator is zeroed at a
  group's first visit and stored to out[g] at its last; both operands are row-masked (`where`,
  so stale or NaN rows outside the group cannot leak in). An empty group gets one visit that
  computes nothing and stores its zero accumulator, so drhs of an unused expert is exactly 0.
- M, K, N need not be multiples of their tiles: edge blocks are padded on read and clipped on
  write by Pallas; gmm masks the K remainder of both operands (it is contracted), while the M
  remainder is covered by the row masks and N/K overhang of outputs is clipped.

Cost. Each visit is a full-tile matmul, so the MXU work is (visits / T) times the ideal, about
1 + tm * E / M when groups are small: 1.55x for 8192 tokens x top-8 over 288 experts with
tm = 128 (`python -m benchmarks.pallas_moe` prints this per routing skew). Larger batches per
step or a smaller tm shrink it; the weights are streamed once per visit either way.

Backends. Written for TPU (Mosaic): `pltpu.PrefetchScalarGridSpec`, a dynamic grid bound,
sequential ("arbitrary") visit axes whose output blocks stay resident in VMEM between
consecutive grid steps, and VMEM scratch accumulators. On TPU, tiles must obey Mosaic's block
rule: tm a multiple of 8 and tk, tn multiples of 128, unless a tile spans its whole dimension
(checked before lowering). Verified here: interpret-mode results on CPU, and that the kernels
lower to Mosaic MLIR for TPU from a CPU host. Not verified: Mosaic compilation by libtpu and any
run on a TPU. GPU is served by the Triton kernels of `pallas_kernels.grouped_matmul_triton`
(same signatures and results; Triton has no scalar prefetch and runs grid programs concurrently,
so they read the same schedule as ordinary int32 arrays and store with row masks). `gmm` below
dispatches: `kernel="mosaic"` (TPU), `"triton"` (GPU), None for the backend's (Triton on GPU,
Mosaic elsewhere); these Mosaic kernels raise on GPU unless interpreted.

`interpret=None` means interpret mode when tracing for the CPU (`pallas_kernels.target`; slow,
tests only).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import grouped_matmul_triton
from pallas_kernels.grouped_common import (
    Schedule,
    Tiling,
    dot_f32,
    gmm_shapes,
    make_schedule,
    matmul_precision,
    resolve_interpret,
    schedule_size,
    tgmm_shapes,
)
from pallas_kernels.target import target_backend


# Per-backend defaults. TPU: 128-row tiles (the MXU width of v4/v5) and 512-wide K/N tiles keep
# the double-buffered bf16 blocks plus the f32 accumulator near 2 MiB of VMEM. Not tuned on
# hardware. Interpret mode: larger tiles mean fewer (slow) interpreted grid steps.
DEFAULT_TILING = {"tpu": Tiling(128, 512, 512), "interpret": Tiling(128, 128, 128)}


def default_tiling(interpret: bool) -> Tiling:
    return DEFAULT_TILING["interpret" if interpret else "tpu"]


def _check_backend(interpret: bool) -> None:
    # Only GPU is refused here: on CPU Pallas itself says that only interpret mode runs, and
    # lowering for TPU from a CPU host (`.lower(lowering_platforms=("tpu",))`) must stay open.
    if not interpret and target_backend() == "gpu":
        raise NotImplementedError(
            "pallas grouped matmul: the Mosaic kernels target TPU and do not lower on GPU; "
            "use kernel='triton' there (the default on GPU), or interpret=True for testing"
        )


def _check_tpu_blocks(tiles: Tiling, m: int, k: int, n: int) -> None:
    """Mosaic block rule: second-minor block dims multiple of 8, minor of 128, or the full dim."""
    for name, tile, dim, multiple in [("rows", tiles.rows, m, 8),
                                      ("contract", tiles.contract, k, 128),
                                      ("cols", tiles.cols, n, 128)]:
        if tile != dim and tile % multiple:
            raise ValueError(f"tiling.{name}={tile}: on TPU it must be a multiple of {multiple} "
                             f"or the whole dimension ({dim})")


def _fit(tiles: Tiling, m: int, k: int, n: int) -> Tiling:
    """Shrinks each tile to its dimension when the dimension is smaller (one full block)."""
    return Tiling(min(tiles.rows, m), min(tiles.contract, k), min(tiles.cols, n))


# ---- kernels ---------------------------------------------------------------------------------


def _zero_where_not(keep, a):
    """where(keep, a, 0) with the select in float32 (older TPUs have no bf16 VPU ops)."""
    return jnp.where(keep, a.astype(jnp.float32), 0.0).astype(a.dtype)


def _gmm_kernel(visit_group, visit_tile, offsets, lhs_ref, rhs_ref, *refs, tm, tk, k_dim,
                transpose_rhs, precision):
    *_, out_ref, acc_ref = refs  # an optional aliased initial output sits before out_ref
    s, k_i = pl.program_id(1), pl.program_id(2)
    g = visit_group[s]
    lo, hi = offsets[g], offsets[g + 1]

    @pl.when(k_i == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(lo < hi)
    def _():
        x, w = lhs_ref[...], rhs_ref[...]
        if k_dim % tk:  # the last K tile overhangs: zero both sides (padding is unspecified)
            k_axis = 1 if transpose_rhs else 0
            x = _zero_where_not(
                jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) + k_i * tk < k_dim, x)
            w = _zero_where_not(
                jax.lax.broadcasted_iota(jnp.int32, w.shape, k_axis) + k_i * tk < k_dim, w)
        contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))
        acc_ref[...] += dot_f32(x, w, contract, precision)

    tile = visit_tile[s]
    first_visit = jnp.logical_or(s == 0, visit_tile[jnp.maximum(s - 1, 0)] != tile)
    last_k = k_i == pl.num_programs(2) - 1

    def rows_of_group():
        rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        return jnp.logical_and(rows >= lo, rows < hi)

    # The first visit to a row tile writes all of it (zeros outside this group); later visits
    # (other groups sharing the tile) overwrite only their own rows.
    @pl.when(jnp.logical_and(last_k, first_visit))
    def _():
        out_ref[...] = jnp.where(rows_of_group(), acc_ref[...], 0.0).astype(out_ref.dtype)

    @pl.when(jnp.logical_and(last_k, jnp.logical_not(first_visit)))
    def _():
        out_ref[...] = jnp.where(rows_of_group(), acc_ref[...],
                                 out_ref[...].astype(jnp.float32)).astype(out_ref.dtype)


def _tgmm_kernel(visit_group, visit_tile, offsets, lhs_ref, rhs_ref, *refs, tm, precision):
    *_, out_ref, acc_ref = refs
    s, last_s = pl.program_id(2), pl.num_programs(2) - 1
    g = visit_group[s]
    lo, hi = offsets[g], offsets[g + 1]

    @pl.when(jnp.logical_or(s == 0, visit_group[jnp.maximum(s - 1, 0)] != g))
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(lo < hi)
    def _():
        x, y = lhs_ref[...], rhs_ref[...]
        row0 = visit_tile[s] * tm

        def rows_of_group(a):  # select, not multiply: NaN/stale rows must not leak in
            rows = row0 + jax.lax.broadcasted_iota(jnp.int32, a.shape, 0)
            return _zero_where_not(jnp.logical_and(rows >= lo, rows < hi), a)

        # x.T @ y as a contraction over the row (second-minor) dim of both operands.
        acc_ref[...] += dot_f32(rows_of_group(x), rows_of_group(y), ((0,), (0,)), precision)

    @pl.when(jnp.logical_or(s == last_s, visit_group[jnp.minimum(s + 1, last_s)] != g))
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _prepare(lhs, rhs, tiling, interpret, k, n):
    interpret = resolve_interpret(interpret)
    _check_backend(interpret)
    tiles = _fit(Tiling(*(tiling or default_tiling(interpret))), lhs.shape[0], k, n)
    if not interpret:
        _check_tpu_blocks(tiles, lhs.shape[0], k, n)
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    return lhs.astype(dtype), rhs.astype(dtype), tiles, interpret, dtype


def _aliased_init_spec(out_init):
    """An initial output buffer aliased to the output (tests poison it with NaN): passed in
    place in memory (`ANY`), never read by the kernel."""
    if out_init is None:
        return [], [], {}
    return [pl.BlockSpec(memory_space=pl.ANY)], [out_init], {5: 0}


def gmm_call(lhs, rhs, group_sizes, *, transpose_rhs=False, tiling=None, interpret=None,
             out_dtype=None, schedule=None, out_init=None):
    """The gmm kernel without autodiff. rhs: [E, K, N], or [E, N, K] with transpose_rhs.

    schedule: `make_schedule(group_sizes, M, tiling.rows, visit_empty_groups=False)` if given
    (e.g. shared by several calls). out_init: optional [M, N] buffer aliased to the output; its
    contents are never used (tests fill it with NaN to prove every element is written).
    """
    m, k, n, out_dtype = gmm_shapes(lhs, rhs, transpose_rhs, out_dtype)
    num_groups = rhs.shape[0]
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    lhs, rhs, tiles, interpret, dtype = _prepare(lhs, rhs, tiling, interpret, k, n)
    tm, tk, tn = tiles
    sched = schedule
    if sched is None:
        sched = make_schedule(group_sizes, m, tm, visit_empty_groups=False)
    last_group = num_groups - 1

    def lhs_map(n_i, s, k_i, visit_group, visit_tile, offsets):
        return visit_tile[s], k_i

    def rhs_map(n_i, s, k_i, visit_group, visit_tile, offsets):
        g = jnp.minimum(visit_group[s], last_group)  # the null group reads (unused) weights
        return (g, n_i, k_i) if transpose_rhs else (g, k_i, n_i)

    def out_map(n_i, s, k_i, visit_group, visit_tile, offsets):
        return visit_tile[s], n_i

    rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
    init_specs, init_args, aliases = _aliased_init_spec(out_init)
    kernel = functools.partial(_gmm_kernel, tm=tm, tk=tk, k_dim=k, transpose_rhs=transpose_rhs,
                               precision=matmul_precision(dtype))
    itemsize = jnp.dtype(dtype).itemsize
    cost = pl.CostEstimate(
        flops=2 * m * k * n, transcendentals=0,
        bytes_accessed=itemsize * (m * k * pl.cdiv(n, tn) + num_groups * k * n)
        + out_dtype.itemsize * m * n)
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(pl.cdiv(n, tn), sched.num_visits, pl.cdiv(k, tk)),
            in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec(rhs_block, rhs_map),
                      *init_specs],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name="gmm",
    )
    return call(sched.visit_group, sched.visit_tile, sched.group_offsets, lhs, rhs, *init_args)


def tgmm(lhs, rhs, group_sizes, *, tiling=None, interpret=None, out_dtype=None,
         schedule=None, out_init=None):
    """lhs [M, K], rhs [M, N] -> [E, K, N]: out[g] = lhs[rows of g].T @ rhs[rows of g].

    (The brief's `tgmm(lhs^T, dout)`: the contraction runs over the sorted rows.) `tiling` is
    the forward gmm's: rows reduce, `contract` tiles K and `cols` tiles N. Empty groups give 0.
    schedule / out_init: as in `gmm_call` (with `visit_empty_groups=True`).
    """
    m, k, n, num_groups, out_dtype = tgmm_shapes(lhs, rhs, group_sizes, out_dtype)
    if m == 0:
        return jnp.zeros((num_groups, k, n), out_dtype)
    lhs, rhs, tiles, interpret, dtype = _prepare(lhs, rhs, tiling, interpret, k, n)
    tm, tk, tn = tiles
    sched = schedule
    if sched is None:
        sched = make_schedule(group_sizes, m, tm, visit_empty_groups=True)

    def lhs_map(k_i, n_i, s, visit_group, visit_tile, offsets):
        return visit_tile[s], k_i

    def rhs_map(k_i, n_i, s, visit_group, visit_tile, offsets):
        return visit_tile[s], n_i

    def out_map(k_i, n_i, s, visit_group, visit_tile, offsets):
        return visit_group[s], k_i, n_i

    init_specs, init_args, aliases = _aliased_init_spec(out_init)
    itemsize = jnp.dtype(dtype).itemsize
    cost = pl.CostEstimate(
        flops=2 * m * k * n, transcendentals=0,
        bytes_accessed=itemsize * (m * k * pl.cdiv(n, tn) + m * n * pl.cdiv(k, tk))
        + out_dtype.itemsize * num_groups * k * n)
    call = pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm, precision=matmul_precision(dtype)),
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(pl.cdiv(k, tk), pl.cdiv(n, tn), sched.num_visits),
            in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec((tm, tn), rhs_map),
                      *init_specs],
            out_specs=pl.BlockSpec((None, tk, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
        ),
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name="tgmm",
    )
    return call(sched.visit_group, sched.visit_tile, sched.group_offsets, lhs, rhs, *init_args)


# ---- differentiable gmm ----------------------------------------------------------------------


KERNELS = ("mosaic", "triton")


def resolve_kernel(kernel: str | None) -> str:
    """"mosaic" (TPU) or "triton" (GPU); None picks by the backend traced for (`pallas_kernels.target`): Triton on GPU,
    Mosaic elsewhere (so CPU interpret mode runs the TPU kernels unless told otherwise)."""
    if kernel is None:
        return "triton" if target_backend() == "gpu" else "mosaic"
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS} or None, got {kernel!r}")
    return kernel


def kernel_calls(kernel: str):
    """(gmm_call, tgmm) of a kernel family: same signatures, same results."""
    if kernel == "triton":
        return grouped_matmul_triton.gmm_call, grouped_matmul_triton.tgmm
    return gmm_call, tgmm


class _Config(NamedTuple):
    tiling: Tiling | None
    interpret: bool | None
    kernel: str


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs, rhs, group_sizes, config):
    forward, _ = kernel_calls(config.kernel)
    return forward(lhs, rhs, group_sizes, tiling=config.tiling, interpret=config.interpret)


def _gmm_fwd(lhs, rhs, group_sizes, config):
    return _gmm(lhs, rhs, group_sizes, config), (lhs, rhs, group_sizes)


def _gmm_bwd(config, residuals, dout):
    lhs, rhs, group_sizes = residuals
    tiling = config.tiling
    forward, transposed = kernel_calls(config.kernel)
    # dlhs = dout [M, N] @ rhs[g].T: contracts N (tile `cols`), produces K (tile `contract`).
    back = None if tiling is None else Tiling(tiling.rows, tiling.cols, tiling.contract)
    dlhs = forward(dout, rhs, group_sizes, transpose_rhs=True, tiling=back,
                   interpret=config.interpret, out_dtype=lhs.dtype)
    drhs = transposed(lhs, dout, group_sizes, tiling=tiling, interpret=config.interpret,
                      out_dtype=rhs.dtype)
    return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
        tiling: Tiling | tuple[int, int, int] | None = None,
        interpret: bool | None = None, kernel: str | None = None) -> jax.Array:
    """lhs [M, K] (rows sorted by group), rhs [E, K, N], group_sizes [E] int -> [M, N].

    Differentiable in lhs and rhs. tiling: (rows, contract, cols) tiles or None for the
    kernel's default (`DEFAULT_TILING` here, `grouped_matmul_triton.DEFAULT_TILING`). kernel:
    "mosaic" (TPU), "triton" (GPU) or None for the backend's (`resolve_kernel`).
    """
    tiling = None if tiling is None else Tiling(*tiling)
    config = _Config(tiling, interpret, resolve_kernel(kernel))
    return _gmm(lhs, rhs, group_sizes.astype(jnp.int32), config)
