"""Grouped matmuls for NVIDIA GPUs: `gmm` and `tgmm` as Pallas Triton kernels.

Same signatures and semantics as the Mosaic (TPU) kernels of `pallas_kernels.grouped_matmul`,
whose docstring defines them and the visit schedule:

    gmm_call(lhs [M, K], rhs [E, K, N] (or [E, N, K] with transpose_rhs), group_sizes [E])
        -> [M, N]; rows sorted by group, row r of group g gives lhs[r] @ rhs[g], rows past
        sum(group_sizes) give 0.
    tgmm(lhs [M, K], rhs [M, N], group_sizes [E]) -> [E, K, N]; out[g] = lhs[rows of g].T @
        rhs[rows of g], exactly 0 for an empty group; rows past sum(group_sizes) add nothing.

Why a second pair of kernels: Triton has no scalar prefetch and no dynamic grid bound, and runs
the programs of a grid concurrently in any order, so the TPU kernels' pattern (BlockSpec index
maps reading the schedule, an output tile resident across consecutive sequential grid steps)
does not carry over. Here the schedule (`make_schedule`, computed with jnp) is passed as
ordinary int32 arrays that each program reads, and every program loads and stores its tiles
itself, with masks (`plgpu.load` / `plgpu.store` on whole-array refs).

- gmm, grid (S visits, N tiles), S = T + E - 1 static: program (s, j) reads its visit (group g,
  row tile t) and loops over K in steps of tk (`lax.fori_loop`, float32 accumulator; a null
  visit of rows past the groups runs no step). Its store is masked to the tile's rows of g,
  plus, for the visit of the group that ends at the last routed row and for null visits, the
  rows past sum(group_sizes), stored as 0. So every output element is written by exactly one
  program: visits to a straddled tile store disjoint rows and need no read-modify-write (which
  would race between concurrent programs). Programs s >= num_visits (the static grid's padding)
  do nothing.
- tgmm, grid (E, K tiles, N tiles): program (g, i, j) walks the group's rows [lo, hi) in
  chunks of tm rows starting at lo (dynamic trip count cdiv(hi - lo, tm); none for an empty
  group, whose tile is stored as exact zeros). Chunks start at the group's first row rather than
  at tm-aligned tiles: on a GPU any row range loads alike, and a group of r rows takes
  cdiv(r, tm) steps. Both operands are loaded with rows outside [lo, hi) as 0, so stale or NaN
  rows (and rows past M) never enter.
- Bounds: every load and store is masked against M, K and N, so no dimension need be a multiple
  of its tile; the contracted remainder loads as 0 on both operands.
- Tiles: Triton tensors need power-of-two shapes and tl.dot at least 16 along each dimension,
  so compiled tiles must be powers of two >= 16 (checked); each tile is capped at its dimension
  rounded up to a power of two. Defaults (128 rows, 64 contract, 128 cols, 4 warps, 3 pipeline
  stages) are the common Triton matmul configuration for bf16 on Ampere/Hopper; 8 warps when an
  output tile holds more than 128 x 128 accumulators, fewer stages when one step's operand
  tiles times the stages would pass SMEM_BUDGET (e.g. float32, or 256-row tiles). Not tuned on
  hardware. float32 inputs use
  IEEE dots (Precision.HIGHEST, no TF32), accumulation is float32.

Verified: interpret-mode results on CPU against float64 references, and the lowering to Triton
IR for CUDA from a CPU host. Not verified: compilation to PTX and any run on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.grouped_common import (
    Tiling,
    dot_f32,
    gmm_shapes,
    make_schedule,
    matmul_precision,
    resolve_interpret,
    tgmm_shapes,
)
from pallas_kernels.target import target_backend

MIN_TILE = 16  # tl.dot needs at least 16 along every dimension
DEFAULT_TILING = {"gpu": Tiling(128, 64, 128), "interpret": Tiling(128, 128, 128)}
NUM_STAGES = 3  # at most; fewer where the pipelined loads would not fit SMEM_BUDGET
SMEM_BUDGET = 160 * 1024  # bytes of pipelined operand tiles (A100: 164 KiB per SM, H100: 228)
WIDE_TILE = 128 * 128  # output tiles with more accumulators than this get 8 warps


def default_tiling(interpret: bool) -> Tiling:
    return DEFAULT_TILING["interpret" if interpret else "gpu"]


def _fit(tiles: Tiling, m: int, k: int, n: int) -> Tiling:
    """Caps each tile at its dimension rounded up to a power of two (at least MIN_TILE): one
    masked block when the dimension is small, still a legal Triton shape."""
    cap = lambda dim: max(MIN_TILE, pl.next_power_of_2(dim))
    return Tiling(min(tiles.rows, cap(m)), min(tiles.contract, cap(k)), min(tiles.cols, cap(n)))


def _check_tiles(tiles: Tiling) -> None:
    for name, tile in tiles._asdict().items():
        if tile < MIN_TILE or tile & (tile - 1):
            raise ValueError(f"tiling.{name}={tile}: the Triton kernel needs a power of two "
                             f">= {MIN_TILE}")


def _prepare(lhs, rhs, tiling, interpret, m, k, n):
    """(lhs, rhs in their common dtype, fitted tiles, interpret, dtype); refuses TPU and bad
    compiled tiles. Lowering for CUDA from a CPU host stays open."""
    interpret = resolve_interpret(interpret)
    if not interpret and target_backend() == "tpu":
        raise NotImplementedError("pallas grouped matmul: the Triton kernels target GPU; use "
                                  "kernel='mosaic' on TPU")
    tiles = Tiling(*(tiling or default_tiling(interpret)))
    if any(not isinstance(t, int) or t < 1 for t in tiles):
        raise ValueError(f"tiling: expected three positive ints, got {tuple(tiles)}")
    tiles = _fit(tiles, m, k, n)
    if not interpret:
        _check_tiles(tiles)
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    return lhs.astype(dtype), rhs.astype(dtype), tiles, interpret, dtype


def num_stages(stage_bytes: int) -> int:
    """Software-pipelining depth of the K (or row) loop: each stage holds one step's operand
    tiles in shared memory, so deep pipelines of wide tiles would not fit."""
    return max(1, min(NUM_STAGES, SMEM_BUDGET // stage_bytes))


def _call(kernel, *, name, grid, out_shape, args, out_init, interpret, out_tile, stage_bytes):
    """pl.pallas_call over whole-array refs. out_init: an optional buffer aliased to the output
    (tests fill it with NaN to prove every element is written); the kernel never sees it.
    out_tile: accumulators per program; stage_bytes: bytes of the operand tiles of one step."""
    params = None
    if not interpret:
        params = plgpu.CompilerParams(num_warps=4 if out_tile <= WIDE_TILE else 8,
                                      num_stages=num_stages(stage_bytes))
    aliases = {}
    if out_init is not None:
        aliases = {len(args): 0}
        args = (*args, out_init)
        body = kernel

        def kernel(*refs):
            return body(*refs[:-2], refs[-1])

    return pl.pallas_call(kernel, grid=grid, out_shape=out_shape, input_output_aliases=aliases,
                          compiler_params=params, interpret=interpret, name=name)(*args)


def _range(block, size: int):
    """[size] int32 indices of the block-th tile of `size`."""
    return block * size + jnp.arange(size, dtype=jnp.int32)


def _cdiv(a, b: int):
    """Ceiling division of a non-negative traced int32 scalar (lax.div truncates)."""
    return lax.div(a + (b - 1), jnp.asarray(b, a.dtype))


# ---- kernels ---------------------------------------------------------------------------------


def _gmm_kernel(visit_group_ref, visit_tile_ref, offsets_ref, num_visits_ref, lhs_ref, rhs_ref,
                out_ref, *, tiles: Tiling, dims, num_groups, transpose_rhs, precision):
    tm, tk, tn = tiles
    m, k, n = dims
    s, n_block = pl.program_id(0), pl.program_id(1)

    @pl.when(s < num_visits_ref[0])
    def _():
        g = visit_group_ref[s]
        lo, hi, total = offsets_ref[g], offsets_ref[g + 1], offsets_ref[num_groups]
        row0 = visit_tile_ref[s] * tm
        rows, cols = row0 + jnp.arange(tm, dtype=jnp.int32), _range(n_block, tn)
        expert = jnp.minimum(g, num_groups - 1)  # the null group runs no step
        col_slice = pl.ds(n_block * tn, tn)

        def step(k_block, acc):
            ks, k_slice = _range(k_block, tk), pl.ds(k_block * tk, tk)
            x = plgpu.load(lhs_ref.at[pl.ds(row0, tm), k_slice],
                           mask=(rows < m)[:, None] & (ks < k)[None, :], other=0)
            if transpose_rhs:
                w = plgpu.load(rhs_ref.at[expert, col_slice, k_slice],
                               mask=(cols < n)[:, None] & (ks < k)[None, :], other=0)
                return acc + dot_f32(x, w, ((1,), (1,)), precision)
            w = plgpu.load(rhs_ref.at[expert, k_slice, col_slice],
                           mask=(ks < k)[:, None] & (cols < n)[None, :], other=0)
            return acc + dot_f32(x, w, ((1,), (0,)), precision)

        steps = jnp.where(lo < hi, pl.cdiv(k, tk), 0)
        acc = lax.fori_loop(0, steps, step, jnp.zeros((tm, tn), jnp.float32))
        # Rows past the last group belong to the visit whose group ends there (or a null visit).
        owned = (rows >= lo) & ((rows < hi) | (hi == total)) & (rows < m)
        value = jnp.where((rows < hi)[:, None], acc, 0.0).astype(out_ref.dtype)
        plgpu.store(out_ref.at[pl.ds(row0, tm), col_slice], value,
                    mask=owned[:, None] & (cols < n)[None, :])


def _tgmm_kernel(offsets_ref, lhs_ref, rhs_ref, out_ref, *, tiles: Tiling, dims, precision):
    tm, tk, tn = tiles
    _, k, n = dims
    g, k_block, n_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = offsets_ref[g], offsets_ref[g + 1]
    ks, cols = _range(k_block, tk), _range(n_block, tn)
    k_slice, col_slice = pl.ds(k_block * tk, tk), pl.ds(n_block * tn, tn)

    def step(chunk, acc):
        start = lo + chunk * tm
        in_group = (start + jnp.arange(tm, dtype=jnp.int32) < hi)[:, None]
        x = plgpu.load(lhs_ref.at[pl.ds(start, tm), k_slice], mask=in_group & (ks < k)[None, :],
                       other=0)
        y = plgpu.load(rhs_ref.at[pl.ds(start, tm), col_slice],
                       mask=in_group & (cols < n)[None, :], other=0)
        return acc + dot_f32(x, y, ((0,), (0,)), precision)  # x.T @ y over the chunk's rows

    acc = lax.fori_loop(0, _cdiv(hi - lo, tm), step, jnp.zeros((tk, tn), jnp.float32))
    plgpu.store(out_ref.at[g, k_slice, col_slice], acc.astype(out_ref.dtype),
                mask=(ks < k)[:, None] & (cols < n)[None, :])


# ---- calls -----------------------------------------------------------------------------------


def gmm_call(lhs, rhs, group_sizes, *, transpose_rhs=False, tiling=None, interpret=None,
             out_dtype=None, schedule=None, out_init=None):
    """The Triton gmm without autodiff; arguments as `pallas_kernels.grouped_matmul.gmm_call`
    (schedule: `make_schedule(group_sizes, M, rows tile, visit_empty_groups=False)`)."""
    m, k, n, out_dtype = gmm_shapes(lhs, rhs, transpose_rhs, out_dtype)
    num_groups = rhs.shape[0]
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    lhs, rhs, tiles, interpret, dtype = _prepare(lhs, rhs, tiling, interpret, m, k, n)
    sched = schedule
    if sched is None:
        sched = make_schedule(group_sizes, m, tiles.rows, visit_empty_groups=False)
    kernel = functools.partial(_gmm_kernel, tiles=tiles, dims=(m, k, n), num_groups=num_groups,
                               transpose_rhs=transpose_rhs, precision=matmul_precision(dtype))
    return _call(kernel, name="gmm_triton", grid=(sched.visit_group.shape[0],
                                                  pl.cdiv(n, tiles.cols)),
                 out_shape=jax.ShapeDtypeStruct((m, n), out_dtype), out_init=out_init,
                 args=(sched.visit_group, sched.visit_tile, sched.group_offsets,
                       sched.num_visits.reshape(1), lhs, rhs),
                 interpret=interpret, out_tile=tiles.rows * tiles.cols,
                 stage_bytes=(tiles.rows + tiles.cols) * tiles.contract * dtype.itemsize)


def tgmm(lhs, rhs, group_sizes, *, tiling=None, interpret=None, out_dtype=None,
         schedule=None, out_init=None):
    """lhs [M, K], rhs [M, N] -> [E, K, N]: out[g] = lhs[rows of g].T @ rhs[rows of g]; 0 for
    an empty group. Arguments as `pallas_kernels.grouped_matmul.tgmm`; of a schedule only the
    group offsets are used (the kernel walks each group's rows itself)."""
    m, k, n, num_groups, out_dtype = tgmm_shapes(lhs, rhs, group_sizes, out_dtype)
    if m == 0:
        return jnp.zeros((num_groups, k, n), out_dtype)
    lhs, rhs, tiles, interpret, dtype = _prepare(lhs, rhs, tiling, interpret, m, k, n)
    if schedule is None:
        ends = jnp.cumsum(group_sizes.astype(jnp.int32))
        offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), ends])
    else:
        offsets = schedule.group_offsets
    kernel = functools.partial(_tgmm_kernel, tiles=tiles, dims=(m, k, n),
                               precision=matmul_precision(dtype))
    return _call(kernel, name="tgmm_triton",
                 grid=(num_groups, pl.cdiv(k, tiles.contract), pl.cdiv(n, tiles.cols)),
                 out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
                 args=(offsets, lhs, rhs), out_init=out_init, interpret=interpret,
                 out_tile=tiles.contract * tiles.cols,
                 stage_bytes=tiles.rows * (tiles.contract + tiles.cols) * dtype.itemsize)
