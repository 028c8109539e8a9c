"""Pieces shared by the Mosaic GPU flash-attention kernels (pallas_kernels/flash_attention_mgpu.py
forward, flash_attention_mgpu_bwd.py backward): static configuration, shared-memory budget,
the stream of blocks a memory warpgroup feeds to the compute warpgroups, and the split of a
block range into skipped, masked and mask-free steps.

Warp specialisation (the FlashAttention-3 layout of JAX's `attention_mgpu` example): each
program runs `compute_wgs` compute warpgroups, each owning `block` rows of its own, plus one
memory warpgroup that copies the blocks every compute warpgroup walks (KV blocks in the
forward and dq kernels, query blocks in the dk/dv kernel) with TMA into a ring of
`stages` shared-memory slots. Slot s has one "loaded" barrier per streamed array (a barrier
completes on one TMA copy) and one "consumed" barrier that every compute warpgroup arrives
at once it is done with the slot; the memory warpgroup refills a slot only after that.
Barrier phases are tracked per thread, so every compute warpgroup waits on every loaded
barrier of every streamed step, in order, even on steps it does not compute (`Steps.skip`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

NEG = -1e30  # finite "-inf": a fully masked row keeps finite statistics
LOG2E = math.log2(math.e)
SMEM_BYTES = 227 * 1024  # usable shared memory per block on sm90
ROWS = 64  # wgmma M per warpgroup: block sizes are multiples of this
TILE = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # 128-byte swizzled rows


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes of one kernel: rows per compute warpgroup (`block`), rows per streamed step
    (`stream`), compute warpgroups per program, ring slots."""

    block: int
    stream: int
    compute_wgs: int = 2
    stages: int = 2

    def check(self, name: str) -> None:
        for field in ("block", "stream"):
            value = getattr(self, field)
            if value % ROWS or value & (value - 1):
                raise ValueError(f"{name}.{field}: a power of two multiple of {ROWS}, got {value}")
        if self.compute_wgs not in (1, 2) or self.stages < 2:
            raise ValueError(f"{name}: compute_wgs 1 or 2 and stages >= 2, got "
                             f"{self.compute_wgs}, {self.stages}")

    @property
    def tile(self) -> int:
        """Rows of one program: each compute warpgroup owns `block` of them."""
        return self.block * self.compute_wgs


def smem_bytes(own: Sequence[tuple[int, ...]], streamed: Sequence[tuple[int, ...]],
               blocks: Blocks, itemsize: int = 2) -> int:
    """Shared memory of a kernel: `own` buffers (per compute warpgroup) and `streamed` ones (per
    ring slot), each a (rows, width) of 16-bit values or (rows,) of 32-bit ones."""
    def size(shape):
        return shape[0] * 4 if len(shape) == 1 else shape[0] * shape[1] * itemsize
    return (blocks.compute_wgs * sum(map(size, own))
            + blocks.stages * sum(map(size, streamed)))


def check_smem(name: str, needed: int, blocks: Blocks) -> None:
    if needed > SMEM_BYTES:
        raise ValueError(f"{name}: blocks {blocks} need {needed // 1024} KiB of shared memory, "
                         f"over the {SMEM_BYTES // 1024} KiB of sm90; use smaller blocks or "
                         "fewer stages (pallas_kernels/flash_attention_blocks.py)")


class Steps(NamedTuple):
    """A compute warpgroup's walk over the program's streamed steps [first, last], split into
    five consecutive ranges: skip (the program's steps before this warpgroup's own range),
    masked, plain (no element masked), masked, skip (after its own range)."""

    first: jax.Array
    own_first: jax.Array
    plain_first: jax.Array
    plain_end: jax.Array
    own_end: jax.Array
    end: jax.Array

    def ranges(self):
        """[(start, stop, kind)] with kind "skip", "masked" or "plain"."""
        return [(self.first, self.own_first, "skip"), (self.own_first, self.plain_first, "masked"),
                (self.plain_first, self.plain_end, "plain"),
                (self.plain_end, self.own_end, "masked"), (self.own_end, self.end, "skip")]


def steps(first, last, own_first, own_last, plain_first, plain_last, masked_only: bool) -> Steps:
    """Steps over [first, last] of a warpgroup whose own range is [own_first, own_last] and
    whose mask-free blocks are [plain_first, plain_last] (clipped into its own range; empty
    when `masked_only`, e.g. with segment ids, where every block is masked)."""
    own_first = jnp.clip(own_first, first, last + 1)
    own_end = jnp.clip(own_last + 1, own_first, last + 1)
    if masked_only:
        plain_first = plain_end = own_first
    else:
        plain_first = jnp.clip(plain_first, own_first, own_end)
        plain_end = jnp.clip(plain_last + 1, plain_first, own_end)
    return Steps(first, own_first, plain_first, plain_end, own_end, last + 1)


def walk(ring: "Ring", step_range: Steps, body: Callable, carry, *, origin, index_of: Callable):
    """Runs `body(index, slot, masked, carry) -> carry` over `step_range` (index: the block
    index `index_of(step)`; the ring's step counter is step - origin), waiting on the ring's
    loaded barriers at every step and arriving at its consumed barrier after each; skipped
    steps only wait and arrive."""
    def run(kind):
        def one(step, carry):
            slot = ring.slot(step - origin)
            ring.wait_loaded(slot)
            if kind != "skip":
                carry = body(index_of(step), slot, kind == "masked", carry)
            plgpu.barrier_arrive(ring.consumed.at[slot])
            return carry
        return one

    for start, stop, kind in step_range.ranges():
        carry = lax.fori_loop(start, stop, run(kind), carry)
    return carry


@dataclasses.dataclass(frozen=True)
class Ring:
    """The streamed buffers of one kernel: `smem[i]` [stages, ...] per streamed array, a loaded
    barrier array per streamed array and one consumed barrier array."""

    smem: tuple
    loaded: tuple
    consumed: object
    stages: int

    def slot(self, step):
        return lax.rem(step, jnp.asarray(self.stages, step.dtype))

    def wait_loaded(self, slot) -> None:
        for barrier in self.loaded:
            plgpu.barrier_wait(barrier.at[slot])

    def feed(self, sources: Callable, count) -> None:
        """Memory warpgroup: copies step i's blocks `sources(i)` (one GMEM ref view per streamed
        array) into slot i % stages for i in [0, count), refilling a slot once consumed."""
        @pl.loop(0, count)
        def _(i):
            slot = self.slot(i)

            @pl.when(i >= self.stages)
            def _():
                plgpu.barrier_wait(self.consumed.at[slot])

            for src, dst, barrier in zip(sources(i), self.smem, self.loaded):
                plgpu.copy_gmem_to_smem(src, dst.at[slot], barrier.at[slot])


def own_copies(pairs, barrier, wg) -> None:
    """Copies (GMEM view, SMEM buffer [wgs, ...]) pairs into this warpgroup's slot of each
    buffer, barrier [pairs, wgs], and waits for all of them."""
    for i, (src, dst) in enumerate(pairs):
        plgpu.copy_gmem_to_smem(src, dst.at[wg], barrier.at[i, wg])
    for i in range(len(pairs)):
        plgpu.barrier_wait(barrier.at[i, wg])


def ring_scratch(shapes: Sequence[tuple[tuple[int, ...], object]], blocks: Blocks):
    """Scratch types of a Ring: SMEM [stages, *shape] per (shape, dtype) (2-D ones swizzled for
    wgmma), their loaded barriers and the consumed barrier."""
    smem = tuple(plgpu.SMEM((blocks.stages, *shape), dtype, transforms=TILE if len(shape) == 2
                            else ()) for shape, dtype in shapes)
    loaded = tuple(plgpu.Barrier(num_barriers=blocks.stages) for _ in shapes)
    consumed = plgpu.Barrier(num_arrivals=blocks.compute_wgs, num_barriers=blocks.stages)
    return smem, loaded, consumed


def plain_blocks(first_row, rows: int, block: int, window: int | None):
    """(first, last) blocks of `block` keys that every query of rows [first_row, first_row +
    rows) sees entirely (no element masked): below the diagonal and inside the window."""
    plain_last = lax.div(first_row + 1, block) - 1
    if window is None:
        return 0, plain_last
    return pl.cdiv(jnp.maximum(first_row + rows - window, 0), block), plain_last


def plain_query_blocks(first_key, keys: int, block: int, window: int | None, last):
    """(first, last) blocks of `block` queries that see every key of [first_key, first_key +
    keys) (the transpose of `plain_blocks`; `last`: the program's last query block)."""
    plain_first = pl.cdiv(first_key + keys - 1, block)
    if window is None:
        return plain_first, last
    # floor((first_key + W - block) / block), with first_key + W >= 0
    return plain_first, lax.div(first_key + window, block) - 1


def broadcast(vector, shape: tuple[int, int], axis: int):
    """A vector indexed along `axis` broadcast to a [rows, cols] wgmma-layout array."""
    return lax.broadcast_in_dim(vector, shape, [axis])


def load_vector(ref, axis: int):
    """A 1-D SMEM buffer as a vector in the layout of `axis` of a wgmma result."""
    return plgpu.load(ref, (), layout=vector_layout(axis))


def vector_layout(axis: int):
    """Layout of a vector indexed along `axis` of a [rows, cols] wgmma result (axis 0: one value
    per row, like the log-sum-exp of a query block; axis 1: one per column)."""
    return plgpu.Layout.WGMMA.reduce(1 - axis)


def positions(start, shape: tuple[int, int], axis: int):
    """start + iota along `axis` of a [rows, cols] wgmma-layout array (int32)."""
    return start + plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


def visible(query_pos, key_pos, window: int | None, q_seg=None, k_seg=None):
    """Causal (+window, +segment) visibility of [rows, cols] position grids."""
    mask = key_pos <= query_pos
    if window is not None:
        mask = mask & (query_pos - key_pos < window)
    if q_seg is not None:
        mask = mask & (q_seg == k_seg)
    return mask


def compiler_params():
    """Lane semantics pinned: the lowering the kernels were written and lowered against on both
    JAX 0.10.2 (its default) and 0.11 (whose default became Warpgroup)."""
    return plgpu.CompilerParams(approx_math=True,
                                lowering_semantics=plgpu.LoweringSemantics.Lane)


def matmul(a, b, shape: tuple[int, int], acc=None):
    """wgmma a @ b into a fresh [shape] float32 accumulator, or onto `acc` (registers)."""
    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]
    if acc is None:
        return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

    def accumulate(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
    return pl.run_state(accumulate)(plgpu.ACC.init(acc))


def transposed(ref):
    return plgpu.transpose_ref(ref, (1, 0))


def zeros(shape):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def full_rows(value: float, rows: int):
    return plgpu.layout_cast(jnp.full((rows,), value, jnp.float32), vector_layout(0))
