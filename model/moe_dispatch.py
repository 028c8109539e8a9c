"""Routed-expert computation behind `moe_impl` (DESIGN.md §2, §5). Dropless: every routed copy
of every token is computed.

Common frame: the N*k token copies are stably sorted by expert id, run through their expert's
SwiGLU, then un-sorted and combined with the router weights. Implementations differ only in how
the sorted rows meet their expert's weights:

- `sorted` (CPU default): rows padded per expert to a multiple of a row block; a loop over the
  blocks multiplies each by its expert's weights and skips the unused tail of the static
  worst-case block count (`model.block_matmul`). `ragged_dot` is ~100x slower on CPU
  (DESIGN.md §5, README benchmarks).
- `ragged_dot`: `jax.lax.ragged_dot` grouped matmuls (GPU/TPU).
- `pallas`: registered by `pallas_kernels`.

Each implementation returns the per-row expert output and the per-row squared norm of the SwiGLU
intermediate, from which the stability monitors' per-expert statistics are derived (report 4.1.2).
"""

from __future__ import annotations

import importlib
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from model.block_matmul import block_grouped_matmul
from model.ffn import swiglu_activation


class ExpertWeights(NamedTuple):
    gate: jax.Array  # [E, D, F]
    up: jax.Array  # [E, D, F]
    down: jax.Array  # [E, F, D]


# (rows [M, D] sorted by expert, row_expert [M], group_sizes [E], weights, limit, block_size)
#   -> (out [M, D], intermediate squared norm [M] float32)
GroupedFFN = Callable[..., tuple[jax.Array, jax.Array]]


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def row_block_size(num_rows: int, num_experts: int, max_block: int) -> int:
    """Row block for the `sorted` path: about a quarter of the mean rows per expert.

    Static padding costs up to (block - 1) rows per expert, so the padded rows are at most
    num_rows * (1 + ~1/4); the block stays >= 8 for matmul efficiency and <= max_block.
    """
    target = _next_power_of_two(max(num_rows // (4 * num_experts), 1))
    return int(min(max_block, max(8, target)))


def sorted_block_ffn(rows, row_expert, group_sizes, weights: ExpertWeights, limit, block_size):
    num_rows, d_model = rows.shape
    num_experts = group_sizes.shape[0]
    block = row_block_size(num_rows, num_experts, block_size)
    # Static bound: sum_e ceil(n_e / m) <= M / m + min(E, M) * (m - 1) / m.
    num_blocks = -(-(num_rows + min(num_experts, num_rows) * (block - 1)) // block)

    blocks_per_expert = -(-group_sizes // block)
    block_ends = jnp.cumsum(blocks_per_expert)
    padded_starts = (block_ends - blocks_per_expert) * block
    group_starts = jnp.cumsum(group_sizes) - group_sizes
    destination = padded_starts[row_expert] + jnp.arange(num_rows) - group_starts[row_expert]
    block_expert = jnp.searchsorted(block_ends, jnp.arange(num_blocks), side="right")
    block_expert = jnp.minimum(block_expert, num_experts - 1).astype(jnp.int32)
    num_active = block_ends[-1]

    xb = jnp.zeros((num_blocks * block, d_model), rows.dtype).at[destination].set(rows)
    xb = xb.reshape(num_blocks, block, d_model)
    gate = block_grouped_matmul(xb, weights.gate, block_expert, num_active)
    up = block_grouped_matmul(xb, weights.up, block_expert, num_active)
    h = swiglu_activation(gate, up, limit)  # padding rows stay exactly 0
    out = block_grouped_matmul(h, weights.down, block_expert, num_active)
    h_sq = jnp.sum(jnp.square(h.astype(jnp.float32)), axis=-1).reshape(-1)
    return out.reshape(num_blocks * block, d_model)[destination], h_sq[destination]


def ragged_dot_ffn(rows, row_expert, group_sizes, weights: ExpertWeights, limit, block_size):
    del row_expert, block_size
    gate = jax.lax.ragged_dot(rows, weights.gate, group_sizes)
    up = jax.lax.ragged_dot(rows, weights.up, group_sizes)
    h = swiglu_activation(gate, up, limit)
    out = jax.lax.ragged_dot(h, weights.down, group_sizes)
    return out, jnp.sum(jnp.square(h.astype(jnp.float32)), axis=-1)


_IMPLS: dict[str, GroupedFFN] = {"sorted": sorted_block_ffn, "ragged_dot": ragged_dot_ffn}
_PROVIDERS = {"pallas": "pallas_kernels"}


def register_moe_impl(name: str, fn: GroupedFFN) -> None:
    _IMPLS[name] = fn


def grouped_ffn(impl: str) -> GroupedFFN:
    if impl not in _IMPLS and impl in _PROVIDERS:
        importlib.import_module(_PROVIDERS[impl])
    if impl not in _IMPLS:
        raise ValueError(
            f"moe_impl: {impl!r} has no registered kernel (available: {sorted(_IMPLS)}); "
            f"the Pallas kernels are added by the `pallas_kernels` package"
        )
    return _IMPLS[impl]


def routed_experts(x, indices, combine_weights, weights: ExpertWeights, *, limit: float,
                   impl: str, block_size: int):
    """x: [N, D]; indices/combine_weights: [N, k] -> (y [N, D], per-expert stats dict of [E])."""
    num_tokens, top_k = indices.shape
    num_experts = weights.gate.shape[0]
    flat_expert = indices.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)  # copy ids sorted by expert
    row_expert = flat_expert[order]
    rows = x[order // top_k]
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)

    out, h_sq = grouped_ffn(impl)(rows, row_expert, group_sizes, weights, limit, block_size)

    copies = jnp.zeros_like(out).at[order].set(out).reshape(num_tokens, top_k, -1)
    y = jnp.einsum("nkd,nk->nd", copies.astype(jnp.float32), combine_weights).astype(x.dtype)
    return y, expert_statistics(out, h_sq, row_expert, group_sizes, weights.gate.shape[-1])


def expert_statistics(out, h_sq, row_expert, group_sizes, hidden: int) -> dict:
    """Per-expert health signals (report 4.1.2-4.1.3), without gradient. Empty experts give 0."""
    out, h_sq = jax.lax.stop_gradient((out, h_sq))
    num_experts = group_sizes.shape[0]
    count = jnp.maximum(group_sizes, 1).astype(jnp.float32)
    out_norm = jnp.linalg.norm(out.astype(jnp.float32), axis=-1)
    seg = dict(segment_ids=row_expert, num_segments=num_experts, indices_are_sorted=True)
    return {
        "expert_tokens": group_sizes.astype(jnp.float32),
        "expert_act_rms": jnp.sqrt(jax.ops.segment_sum(h_sq, **seg) / (count * hidden)),
        "expert_out_norm_mean": jax.ops.segment_sum(out_norm, **seg) / count,
        "expert_out_norm_max": jnp.maximum(jax.ops.segment_max(out_norm, **seg), 0.0),
    }
