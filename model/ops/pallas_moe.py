"""`moe_impl=pallas`: routed experts on grouped-matmul kernels (docs/architecture.md,
"Implementation tables").

    dispatch        token copies -> rows sorted (stably) by expert, plus group sizes
    expert_swiglu   gate/up as one grouped matmul, SwiGLU with the report's clamp (4.1.3),
                    down; a hand-written VJP (model/ops/expert_swiglu.py)
    return          rows back to [N, k, D] token-copy order

`pallas_moe_ffn` has the `moe_impl` signature (`model.ops.tables`) and returns what `sorted` and
`ragged_dot` return: per-copy outputs [N, k, D] and the per-expert statistic sums. The row
permutations are XLA gathers in both directions (`model.ops.permute`); the expert matmuls run on
the kernel family chosen per leg and matmul (`pallas_kernels.grouped_leg_table`: Mosaic GPU /
Triton on NVIDIA GPUs, Mosaic on TPU and, interpreted, on CPU).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from model.ops.expert_swiglu import ExpertPlan, expert_swiglu
from model.ops.moe_dispatch import (
    ExpertWeights,
    dispatch_rows,
    expert_statistic_sums,
    return_rows,
    squared_norms,
)
from model.ops.swiglu import SwiGLUClamp
from pallas_kernels import grouped_leg_table, grouped_matmul, grouped_matmul_triton
from pallas_kernels.grouped_common import Tiling, resolve_interpret
from pallas_kernels.grouped_legs import LegChoice, LegPlan
from pallas_kernels.saved_names import EXPERT_OUT

TILED = {"triton": grouped_matmul_triton.default_tiling,
         "mosaic_tpu": grouped_matmul.default_tiling}


def moe_tiling(backend: str, block_size: int, interpret: bool) -> Tiling:
    """Tiles of a Triton or Mosaic TPU grouped matmul for `moe.block_size` rows: the kernel's
    default contract/cols tiles, and block_size rows, rounded up where compiled kernels need it
    (Mosaic: a multiple of 8, the sublane count; Triton: a power of two >= 16, its tensor-shape
    rule)."""
    tiles = TILED[backend](interpret)
    if interpret:
        rows = block_size
    elif backend == "triton":
        rows = max(grouped_matmul_triton.MIN_TILE, pl.next_power_of_2(block_size))
    else:
        rows = -(-block_size // 8) * 8
    return tiles._replace(rows=rows)


def _with_tiles(plan: LegPlan, block_size: int, interpret: bool) -> LegPlan:
    """Fills the configs a plan leaves open for tiled kernels with `moe_tiling`; the dx leg
    contracts the forward's output columns and produces its contracted ones (tiles swapped)."""

    def fill(choice: LegChoice, leg: str) -> LegChoice:
        if choice.config is not None or choice.backend not in TILED:
            return choice
        tiles = moe_tiling(choice.backend, block_size, interpret)
        if leg == "dx":
            tiles = Tiling(tiles.rows, tiles.cols, tiles.contract)
        return choice._replace(config=tiles)

    return LegPlan(*(fill(choice, leg) for choice, leg in zip(plan, plan._fields)))


def expert_matmuls(d_model: int, hidden: int) -> dict[str, tuple[int, int]]:
    """(k, n) of the forward of each expert matmul: [M, k] x [E, k, n]."""
    return {"gate_up": (d_model, 2 * hidden), "down": (hidden, d_model)}


def leg_widths(k: int, n: int) -> dict[str, tuple[int, int]]:
    """(k, n) of each leg of a matmul [M, k] x [E, k, n] as the choice table keys them: the
    leg's lhs columns and output columns (dx: [M, n] x the transposed weights -> [M, k])."""
    return {"fwd": (k, n), "dx": (n, k), "dw": (k, n)}


def _table_plan(k: int, n: int, dtype) -> LegPlan:
    widths = leg_widths(k, n)
    return LegPlan(*(grouped_leg_table.choose(leg, *widths[leg], dtype)
                     for leg in LegPlan._fields))


def expert_plan(legs: LegPlan | str | None, d_model: int, hidden: int, dtype, block_size: int,
                interpret: bool) -> ExpertPlan:
    """The kernels of both expert matmuls: `legs` for both (a backend name: that family on
    every leg), or None for the table's choice per leg and shape."""
    if isinstance(legs, str):
        legs = LegPlan.uniform(legs)
    if legs is None:
        plan = ExpertPlan(*(_table_plan(k, n, dtype)
                            for k, n in expert_matmuls(d_model, hidden).values()))
    else:
        plan = ExpertPlan(legs, legs)
    return ExpertPlan(*(_with_tiles(p, block_size, interpret) for p in plan))


def pallas_moe_ffn(x, indices, weights: ExpertWeights, clamp: SwiGLUClamp, block_size, *,
                   legs: LegPlan | str | None = None, interpret: bool | None = None):
    """x [N, D], indices [N, k] -> (per-copy expert outputs [N, k, D], per-expert statistic
    sums of [E]; see `model.ops.moe_dispatch`). Copies of "no expert" (id E) give zero rows.

    legs: the kernels (`expert_plan`); block_size: the row tile of Triton / Mosaic TPU legs
    without a config. interpret=None: interpret mode on CPU.
    """
    num_experts, d_model, hidden = weights.gate.shape
    interpret = resolve_interpret(interpret)
    plan = expert_plan(legs, d_model, hidden, x.dtype, block_size, interpret)
    rows, dispatch = dispatch_rows(x, indices, num_experts)
    gate_up = jnp.concatenate([weights.gate, weights.up], axis=-1)
    sizes = dispatch.copies.group_sizes
    out, h_sq = expert_swiglu(rows, gate_up, weights.down, sizes, clamp, plan, interpret)
    out = checkpoint_name(out, EXPERT_OUT)
    sums = expert_statistic_sums(squared_norms(out), h_sq, dispatch.copies.row_expert, sizes)
    return return_rows(out, dispatch, indices.shape[1]), sums
