"""Routed-expert computation behind `moe_impl` (docs/architecture.md, "Implementation
tables"). Dropless: every routed copy of every token is computed.

Common frame: the N*k token copies are stably sorted by expert id ("permute"), run through their
expert's SwiGLU, then brought back to token order ("unpermute") and combined with the router
weights. Implementations differ in how the sorted rows meet their expert's weights:

- `sorted` (CPU default): rows padded per expert to a multiple of a row block; a loop over the
  blocks multiplies each by its expert's weights and skips the unused tail of the static
  worst-case block count (`model.ops.block_matmul`). `ragged_dot` is ~100x slower on CPU
  (docs/architecture.md, "Measured on CPU"; README, Performance).
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

from model.ops.block_matmul import block_grouped_matmul
from model.ops.swiglu import swiglu_activation


class ExpertWeights(NamedTuple):
    gate: jax.Array  # [E, D, F]
    up: jax.Array  # [E, D, F]
    down: jax.Array  # [E, F, D]


# (x [N, D], indices [N, k], weights, limit, block_size)
#   -> (per-copy expert outputs [N, k, D], per-expert statistic sums, dict of [E] arrays)
GroupedFFN = Callable[..., tuple[jax.Array, dict]]


class SortedCopies(NamedTuple):
    order: jax.Array  # [M] copy ids (token * k + slot) sorted by expert, stable
    row_expert: jax.Array  # [M] expert of each sorted row (non-decreasing)
    group_sizes: jax.Array  # [E] int32 rows per expert


def sort_copies(indices: jax.Array, num_experts: int) -> SortedCopies:
    """indices [N, k] -> the N*k routed copies stably sorted by expert id (the "permute")."""
    flat_expert = jnp.asarray(indices).reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    return SortedCopies(order, flat_expert[order], group_sizes)


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def row_block_size(num_rows: int, num_experts: int, max_block: int) -> int:
    """Row block for the `sorted` path: about a quarter of the mean rows per expert.

    Each expert's last block is partly padding: at most E * (block - 1) rows, under num_rows / 2
    with this choice (rounding up to a power of two can double the quarter), about half that
    on average. The block stays >= 8 for matmul efficiency (then padding can exceed num_rows,
    e.g. at decode time) and <= max_block.
    """
    target = _next_power_of_two(max(num_rows // (4 * num_experts), 1))
    return int(min(max_block, max(8, target)))


def sorted_block_ffn(x, indices, weights: ExpertWeights, limit, block_size):
    num_tokens, top_k = indices.shape
    d_model, num_experts = x.shape[1], weights.gate.shape[0]
    num_rows = num_tokens * top_k
    copies = sort_copies(indices, num_experts)
    block = row_block_size(num_rows, num_experts, block_size)
    # Static bound: sum_e ceil(n_e / m) <= M / m + min(E, M) * (m - 1) / m.
    num_blocks = -(-(num_rows + min(num_experts, num_rows) * (block - 1)) // block)

    # Padded layout: expert e's rows start at a block boundary.
    blocks_per_expert = -(-copies.group_sizes // block)
    block_ends = jnp.cumsum(blocks_per_expert)
    padded_starts = (block_ends - blocks_per_expert) * block
    group_starts = jnp.cumsum(copies.group_sizes) - copies.group_sizes
    padded_rows = num_blocks * block
    rank = jnp.arange(num_rows) - group_starts[copies.row_expert]
    # Padded row of each sorted copy; "no expert" copies point past the end and are dropped.
    destination = jnp.where(copies.row_expert < num_experts,
                            padded_starts[copies.row_expert] + rank, padded_rows)
    block_expert = jnp.searchsorted(block_ends, jnp.arange(num_blocks), side="right")
    block_expert = jnp.minimum(block_expert, num_experts - 1).astype(jnp.int32)

    # One gather in (token rows straight into the padded buffer) and one gather out.
    padded_token = jnp.zeros((padded_rows,), jnp.int32).at[destination].set(
        copies.order // top_k)
    occupied = jnp.zeros((padded_rows,), bool).at[destination].set(True)
    xb = jnp.where(occupied[:, None], x[padded_token], 0).reshape(num_blocks, block, d_model)

    num_active = block_ends[-1]
    gate = block_grouped_matmul(xb, weights.gate, block_expert, num_active)
    up = block_grouped_matmul(xb, weights.up, block_expert, num_active)
    h = swiglu_activation(gate, up, limit)  # padding rows stay exactly 0
    out = block_grouped_matmul(h, weights.down, block_expert, num_active).reshape(padded_rows, -1)

    copy_row = jnp.zeros((num_rows,), jnp.int32).at[copies.order].set(destination)
    sums = expert_statistic_sums(out, jnp.sum(jnp.square(h.astype(jnp.float32)), -1).reshape(-1),
                                 jnp.repeat(block_expert, block), copies.group_sizes)
    copy_out = jnp.where((copy_row < padded_rows)[:, None], out[copy_row], 0)
    return copy_out.reshape(num_tokens, top_k, d_model), sums


def ragged_dot_ffn(x, indices, weights: ExpertWeights, limit, block_size):
    del block_size
    num_tokens, top_k = indices.shape
    copies = sort_copies(indices, weights.gate.shape[0])
    rows = x[copies.order // top_k]
    gate = jax.lax.ragged_dot(rows, weights.gate, copies.group_sizes)
    up = jax.lax.ragged_dot(rows, weights.up, copies.group_sizes)
    h = swiglu_activation(gate, up, limit)
    out = jax.lax.ragged_dot(h, weights.down, copies.group_sizes)
    out = jnp.where((copies.row_expert < weights.gate.shape[0])[:, None], out, 0)
    sums = expert_statistic_sums(out, jnp.sum(jnp.square(h.astype(jnp.float32)), axis=-1),
                                 copies.row_expert, copies.group_sizes)
    unsorted = jnp.zeros_like(out).at[copies.order].set(out)
    return unsorted.reshape(num_tokens, top_k, -1), sums


def combine_copies(copy_out, combine_weights, dtype):
    """copy_out [N, k, D], combine_weights [N, k] -> router-weighted sum [N, D] (float32 sum)."""
    y = jnp.einsum("nkd,nk->nd", copy_out.astype(jnp.float32), combine_weights)
    return y.astype(dtype)


def expert_statistic_sums(out, h_sq, row_expert, group_sizes) -> dict:
    """Per-expert sums behind the health signals (report 4.1.2-4.1.3), without gradient.

    out: [R, D] expert outputs, h_sq: [R] squared norms of the SwiGLU intermediate, row_expert:
    [R] non-decreasing expert ids (ids >= E are ignored). All-zero padding rows add nothing.
    Returns `expert_tokens`, `h_sq_sum`, `out_norm_sum`, `expert_out_norm_max`, each [E].
    """
    out, h_sq = jax.lax.stop_gradient((out, h_sq))
    num_experts = group_sizes.shape[0]
    out_norm = jnp.linalg.norm(out.astype(jnp.float32), axis=-1)
    seg = dict(segment_ids=row_expert, num_segments=num_experts, indices_are_sorted=True)
    return {
        "expert_tokens": group_sizes.astype(jnp.float32),
        "h_sq_sum": jax.ops.segment_sum(h_sq, **seg),
        "out_norm_sum": jax.ops.segment_sum(out_norm, **seg),
        "expert_out_norm_max": jnp.maximum(jax.ops.segment_max(out_norm, **seg), 0.0),
    }


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
