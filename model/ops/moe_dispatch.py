"""Routed-expert computation behind `moe_impl` (docs/architecture.md, "Implementation
tables"). Dropless: every routed copy of every token is computed.

Common frame: the N*k token copies are stably sorted by expert id ("permute"), run through their
expert's SwiGLU, then brought back to token order ("unpermute") and combined with the router
weights. `sorted` and `ragged_dot` permute with gathers whose gradients are gathers too
(`model.ops.permute`). Implementations differ in how the sorted rows meet their expert's weights:

- `sorted` (CPU default): a loop over the experts runs each one's SwiGLU on its (contiguous)
  sorted rows in row chunks of a few static sizes, at most `block_size` rows, one plain matmul
  per projection and chunk (`model.ops.grouped_swiglu`); no padding. `ragged_dot` is ~100x slower
  on CPU (docs/architecture.md, "Measured on CPU"; docs/performance.md).
- `ragged_dot`: `jax.lax.ragged_dot` grouped matmuls (GPU/TPU).
- `pallas`: `model.ops.pallas_moe` on the grouped-matmul kernels of `pallas_kernels`.

`model.ops.tables.MOE` names the function of each `moe_impl`.

Each implementation returns the per-copy expert outputs and per-expert statistic sums
(`expert_statistic_sums`) that `finalize_statistics` turns into what the stability monitors
need (report 4.1.2); sums, so that expert parallelism can add them over devices first.

An expert id equal to the number of experts means "no expert" (padding rows of the
expert-parallel exchange): such copies produce zero output and enter no statistic.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from model.ops.grouped_swiglu import chunk_sizes, grouped_swiglu
from model.ops.permute import permute_rows
from model.ops.swiglu import SwiGLUClamp, swiglu_activation
from pallas_kernels.saved_names import EXPERT_GATE_UP, EXPERT_OUT


class ExpertWeights(NamedTuple):
    gate: jax.Array  # [E, D, F]
    up: jax.Array  # [E, D, F]
    down: jax.Array  # [E, F, D]


# (x [N, D], indices [N, k], weights, SwiGLUClamp, block_size)
#   -> (per-copy expert outputs [N, k, D], per-expert statistic sums, dict of [E] arrays)
GroupedFFN = Callable[..., tuple[jax.Array, dict]]


class SortedCopies(NamedTuple):
    order: jax.Array  # [M] copy ids (token * k + slot) sorted by expert, stable
    row_expert: jax.Array  # [M] expert of each sorted row (non-decreasing)
    group_sizes: jax.Array  # [E] int32 rows per expert


@jax.named_scope("dispatch")
def sort_copies(indices: jax.Array, num_experts: int) -> SortedCopies:
    """indices [N, k] -> the N*k routed copies stably sorted by expert id (the "permute")."""
    flat_expert = jnp.asarray(indices).reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    return SortedCopies(order, flat_expert[order], group_sizes)


def sorted_block_ffn(x, indices, weights: ExpertWeights, clamp: SwiGLUClamp, block_size):
    num_tokens, top_k = indices.shape
    num_experts = weights.gate.shape[0]
    num_copies = num_tokens * top_k
    copies = sort_copies(indices, num_experts)
    sizes = chunk_sizes(num_copies, block_size)
    slack = sizes[0]  # rows after the last expert's, for its last chunk to run into
    routed = copies.row_expert < num_experts
    # Sorted row of each copy and copy of each row; "no expert" copies and slack rows get an
    # out-of-range index, i.e. a zero row in the gathers.
    copy_row = jnp.zeros((num_copies,), jnp.int32).at[copies.order].set(
        jnp.where(routed, jnp.arange(num_copies, dtype=jnp.int32), num_copies + slack))
    row_copy = jnp.concatenate([jnp.where(routed, copies.order, num_copies).astype(jnp.int32),
                                jnp.full((slack,), num_copies, jnp.int32)])
    rows = permute_rows(x, row_copy // top_k, copy_row.reshape(num_tokens, top_k))

    starts = jnp.cumsum(copies.group_sizes) - copies.group_sizes
    out, h_sq, out_sq = grouped_swiglu(rows, *weights, starts, copies.group_sizes, clamp, sizes)
    out = checkpoint_name(out, EXPERT_OUT)
    row_expert = jnp.concatenate([copies.row_expert, jnp.full((slack,), num_experts,
                                                               copies.row_expert.dtype)])
    sums = expert_statistic_sums(out_sq, h_sq, row_expert, copies.group_sizes)
    copy_out = permute_rows(out, copy_row, row_copy[:, None])
    return copy_out.reshape(num_tokens, top_k, -1), sums


class Dispatch(NamedTuple):
    """Where each routed copy sits among the rows sorted by expert."""

    copies: SortedCopies
    copy_row: jax.Array  # [N*k] sorted row of copy (token * k + slot)


@jax.named_scope("dispatch")
def dispatch_rows(x: jax.Array, indices: jax.Array, num_experts: int) -> tuple[jax.Array, Dispatch]:
    """x [N, D], indices [N, k] -> (rows [N*k, D] sorted by expert, the dispatch): row i is
    token `order[i] // k`; the copies of "no expert" (id E) come last, past sum(group_sizes)."""
    num_tokens, top_k = indices.shape
    num_copies = num_tokens * top_k
    copies = sort_copies(indices, num_experts)
    copy_row = jnp.zeros((num_copies,), jnp.int32).at[copies.order].set(
        jnp.arange(num_copies, dtype=jnp.int32))
    rows = permute_rows(x, copies.order // top_k, copy_row.reshape(num_tokens, top_k))
    return rows, Dispatch(copies, copy_row)


def return_rows(out: jax.Array, dispatch: Dispatch, top_k: int) -> jax.Array:
    """out [N*k, D] in expert order -> [N, k, D] in token-copy order."""
    copy_out = permute_rows(out, dispatch.copy_row, dispatch.copies.order[:, None])
    return copy_out.reshape(-1, top_k, out.shape[-1])


def ragged_dot_ffn(x, indices, weights: ExpertWeights, clamp: SwiGLUClamp, block_size):
    del block_size
    rows, dispatch = dispatch_rows(x, indices, weights.gate.shape[0])
    copies = dispatch.copies
    gate, up = (checkpoint_name(jax.lax.ragged_dot(rows, w, copies.group_sizes), EXPERT_GATE_UP)
                for w in (weights.gate, weights.up))
    h = swiglu_activation(gate, up, clamp)
    out = jax.lax.ragged_dot(h, weights.down, copies.group_sizes)
    out = jnp.where((copies.row_expert < weights.gate.shape[0])[:, None], out, 0)
    out = checkpoint_name(out, EXPERT_OUT)
    sums = expert_statistic_sums(squared_norms(out), squared_norms(h), copies.row_expert,
                                 copies.group_sizes)
    return return_rows(out, dispatch, indices.shape[1]), sums


def combine_copies(copy_out, combine_weights, dtype):
    """copy_out [N, k, D], combine_weights [N, k] -> router-weighted sum [N, D] (float32 sum)."""
    y = jnp.einsum("nkd,nk->nd", copy_out.astype(jnp.float32), combine_weights)
    return y.astype(dtype)


def squared_norms(x: jax.Array) -> jax.Array:
    """[R, n] -> [R] float32 squared norms of the rows."""
    return jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1)


@jax.named_scope("monitors")
def expert_statistic_sums(out_sq, h_sq, row_expert, group_sizes) -> dict:
    """Per-expert sums behind the health signals (report 4.1.2-4.1.3), without gradient.

    out_sq / h_sq: [R] squared norms of the expert outputs / SwiGLU intermediates (float32),
    row_expert: [R] non-decreasing expert ids (ids >= E are ignored). All-zero padding rows add
    nothing. Returns `expert_tokens`, `h_sq_sum`, `out_norm_sum`, `expert_out_norm_max`, each
    [E].
    """
    out_sq, h_sq = jax.lax.stop_gradient((out_sq, h_sq))
    num_experts = group_sizes.shape[0]
    out_norm = jnp.sqrt(out_sq)
    seg = dict(segment_ids=row_expert, num_segments=num_experts, indices_are_sorted=True)
    return {
        "expert_tokens": group_sizes.astype(jnp.float32),
        "h_sq_sum": jax.ops.segment_sum(h_sq, **seg),
        "out_norm_sum": jax.ops.segment_sum(out_norm, **seg),
        "expert_out_norm_max": jnp.maximum(jax.ops.segment_max(out_norm, **seg), 0.0),
    }


def merge_statistic_sums(sums: dict, add: Callable, peak: Callable) -> dict:
    """`expert_statistic_sums` stacked or split over pieces of the rows -> those of all the
    rows: `peak` (a maximum) of `expert_out_norm_max`, `add` of the others."""
    return {k: (peak if k == "expert_out_norm_max" else add)(v) for k, v in sums.items()}


def finalize_statistics(sums: dict, hidden: int) -> dict:
    """Sums -> the monitors' per-expert statistics; experts without tokens give 0.
    `expert_tokens` (routed copies), `expert_act_rms` (RMS of the SwiGLU intermediate),
    `expert_out_norm_mean` and `expert_out_norm_max` (norm of the expert outputs), each [E]."""
    count = jnp.maximum(sums["expert_tokens"], 1.0)
    return {
        "expert_tokens": sums["expert_tokens"],
        "expert_act_rms": jnp.sqrt(sums["h_sq_sum"] / (count * hidden)),
        "expert_out_norm_mean": sums["out_norm_sum"] / count,
        "expert_out_norm_max": sums["expert_out_norm_max"],
    }
