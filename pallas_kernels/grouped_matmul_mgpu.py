"""Grouped matmuls on NVIDIA Hopper: JAX's Mosaic GPU kernels (wgmma + TMA, persistent over
the SMs) wrapped to the semantics of `pallas_kernels.grouped_matmul`:

    gmm(lhs [M, K], rhs [E, K, N] (or [E, N, K] with transpose_rhs), group_sizes [E]) -> [M, N]
        row r of group g is lhs[r] @ rhs[g]; rows past sum(group_sizes) are 0.
    tgmm(lhs [M, K], rhs [M, N], group_sizes [E]) -> [E, K, N]
        out[g] = lhs[rows of g].T @ rhs[rows of g]; exactly 0 for an empty group.

The kernels are upstream's, called as they are (`jax.experimental.pallas.ops.gpu`, the same
signatures in jax 0.10.2, 0.11.2 and 0.12): `ragged_dot_mgpu.ragged_dot` (forward, and the input
gradient with `transpose_rhs`) and `transposed_ragged_dot_mgpu.transposed_ragged_dot` (the weight
gradient, whose ragged rows are upstream's contraction "k"). What the wrapping adds:
- shape constraints met by zero padding inside the op, only where a dimension is off its block:
  K to block_k (contracted: zeros add nothing), N and M to block_n / block_m (sliced off); tgmm
  pads its rows to block_k. TMA would clip out-of-bounds tiles on a GPU, but the kernels'
  own checks (tgmm: M, N multiples of the blocks) and the interpreter demand whole blocks.
- rows past sum(group_sizes): upstream's gmm never stores them (their memory is unspecified),
  so they are selected to 0 here (an elementwise select XLA fuses into the consumer).
- both operands cast to their common dtype (upstream requires equal dtypes; the output has it).
tgmm masks the rows of other groups inside a group's first and last row block by multiplying
with 0, so rows outside every group must be finite (the MoE's are: real tokens or zeros).

Blocks: `Blocks` holds the kernels' tuning knobs; one wgmma tile is block_m x block_n with a K
step of block_k, `max_concurrent_steps` pipeline stages in shared memory (at most 227 KiB per
block on sm90; lowering refuses more) and `grid_block_n` column tiles per planar-snake band.
The defaults are upstream's benchmark shapes' usual picks, not measured here; the GPU suite's
per-leg sweep (benchmarks/gpu/moe_legs.py) measures alternatives. Dtypes: wgmma takes 16-bit
(and 8-bit) inputs; float32 would run as TF32, so callers keep float32 on other kernels.

Verified on CPU (jax 0.10.2): gmm results in the Mosaic GPU interpreter against float64 loops,
with transpose_rhs emulated there by transposing rhs first (that interpreter has no transposed
shared-memory view); the lowering to a Mosaic GPU custom call for CUDA of gmm with and without
transpose_rhs and of tgmm (whose interpretation needs `layout_cast`, missing from the 0.10.2
interpreter, and a GPU's SM count). Not verified: any run on a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import mosaic_gpu
from pallas_kernels.grouped_common import gmm_shapes, tgmm_shapes


class Blocks(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int
    grid_block_n: int


DEFAULT_BLOCKS = Blocks(128, 128, 64, 4, 1)
# The interpreter runs every grid step in Python: one block per small test dimension.
INTERPRET_BLOCKS = Blocks(64, 64, 64, 2, 1)


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def _pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = _round_up(x.shape[axis], multiple) - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _blocks(blocks, interpret: bool) -> Blocks:
    return Blocks(*(blocks or (INTERPRET_BLOCKS if interpret else DEFAULT_BLOCKS)))


def _rows_in_groups(out: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """out [M, N] with the rows past sum(group_sizes) set to 0."""
    rows = jax.lax.broadcasted_iota(jnp.int32, out.shape, 0)
    return jnp.where(rows < jnp.sum(group_sizes), out, jnp.zeros((), out.dtype))


def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, blocks=None, interpret=False,
        out_dtype=None):
    """lhs [M, K] (rows sorted by group), rhs [E, K, N] ([E, N, K] with transpose_rhs),
    group_sizes [E] int -> [M, N]. blocks: `Blocks` (None: `DEFAULT_BLOCKS`)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    m, _, n, out_dtype = gmm_shapes(lhs, rhs, transpose_rhs, out_dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    b = _blocks(blocks, interpret)
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    if interpret and transpose_rhs:  # no transposed smem view in the 0.10.2 interpreter
        rhs, transpose_rhs = jnp.swapaxes(rhs, 1, 2), False
    k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
    lhs = _pad_axis(_pad_axis(lhs.astype(dtype), 1, b.block_k), 0, b.block_m)
    rhs = _pad_axis(_pad_axis(rhs.astype(dtype), k_axis, b.block_k), n_axis, b.block_n)
    sizes = group_sizes.astype(jnp.int32)

    def call():
        return ragged_dot_mgpu.ragged_dot(
            lhs, rhs, group_sizes=sizes, block_m=b.block_m, block_n=b.block_n,
            block_k=b.block_k, max_concurrent_steps=b.max_concurrent_steps,
            grid_block_n=b.grid_block_n, transpose_rhs=transpose_rhs)

    if interpret:
        with mosaic_gpu.interpret():
            out = call()
    else:
        out = call()
    return _rows_in_groups(out[:m, :n], sizes).astype(out_dtype)


def tgmm(lhs, rhs, group_sizes, *, blocks=None, interpret=False, out_dtype=None):
    """lhs [M, K], rhs [M, N] (rows sorted by group; rows outside every group finite),
    group_sizes [E] int -> [E, K, N]."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    m, k, n, num_groups, out_dtype = tgmm_shapes(lhs, rhs, group_sizes, out_dtype)
    if interpret:
        raise NotImplementedError(
            "Mosaic GPU tgmm: upstream's transposed ragged dot reads the GPU's SM count and "
            "uses layout_cast, so it cannot run in the CPU interpreter; lower it for CUDA instead")
    if m == 0:
        return jnp.zeros((num_groups, k, n), out_dtype)
    b = _blocks(blocks, interpret)
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    # Upstream's names: lhs [k, m] and rhs [k, n] with the ragged rows as "k".
    lhs = _pad_axis(_pad_axis(lhs.astype(dtype), 1, b.block_m), 0, b.block_k)
    rhs = _pad_axis(_pad_axis(rhs.astype(dtype), 1, b.block_n), 0, b.block_k)
    with jax.numpy_dtype_promotion("standard"):  # its dynamic pipeline grid is int32
        out = transposed_ragged_dot_mgpu.transposed_ragged_dot(
            lhs, rhs, group_sizes=group_sizes.astype(jnp.int32), block_m=b.block_m,
            block_n=b.block_n, block_k=b.block_k, max_concurrent_steps=b.max_concurrent_steps,
            grid_block_n=b.grid_block_n)
    return out[:, :k, :n].astype(out_dtype)

