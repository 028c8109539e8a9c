"""Expert parallelism (report 3.2): routed copies travel to the device that owns their expert
over the mesh axis `expert`, run there, and come back. Dropless.

Inside a `shard_map` over the whole mesh each device holds n tokens (the batch is sharded over
`data`, `fsdp` and `expert`, each sequence over `context`) and E / ep experts (weights sharded
over `expert`, gathered over the other axes). Per device:
  1. sort its n*k routed copies by expert, so the copies for each expert-axis peer are one
     contiguous chunk (peer p owns experts [p E/ep, (p+1) E/ep));
  2. exchange chunk sizes (all_to_all), then the chunks themselves (`exchange`);
  3. run the local experts on the received rows (any `moe_impl`);
  4. send the results back along the same routes and combine them with the router weights.
The receive buffer holds ep * n * k rows: dropless needs room for every peer sending all its
copies here (the skewed worst case). Unused rows carry the id "no expert" and cost no FLOPs in
the `sorted` path. `chunk` (model.moe.ep_chunk_tokens) bounds that: each device exchanges its
tokens at most `chunk` at a time (the largest divisor of its token count not above it;
`lax.map`, every chunk rematerialised in the backward pass), so the buffers and the expert
intermediates hold ep * chunk * k rows whatever the batch, for one more pass of the exchange
and the experts in the backward. Same result: a token's copies travel
together, and the statistics add over chunks.

When the tokens are not sharded over `expert` (decoding one row: model/parallel/device_mesh.py's
rules keep the batch whole), every device already holds every token: each runs its own experts
on the copies routed to them and one psum over `expert` adds the results, with no exchange.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model.ops.moe_dispatch import (
    ExpertWeights,
    combine_copies,
    finalize_statistics,
    merge_statistic_sums,
)
from model.ops.swiglu import SwiGLUClamp
from model.ops.tables import MOE
from model.parallel.mesh import logical_spec, spec_axes
from pallas_kernels.target import target_backend

AXIS = "expert"


def resolve_collective(name: str) -> str:
    """`auto` -> `padded` on CPU (XLA:CPU has no ragged-all-to-all), `ragged` elsewhere."""
    if name != "auto":
        return name
    return "padded" if target_backend() == "cpu" else "ragged"


def _exclusive_cumsum(sizes: jax.Array) -> jax.Array:
    return jnp.cumsum(sizes) - sizes


def exchange(rows: jax.Array, send_sizes: jax.Array, recv_sizes: jax.Array, capacity: int,
             collective: str) -> jax.Array:
    """Ragged all-to-all over the `expert` axis (call inside shard_map).

    rows [R, ...]: the chunk for peer p is rows[off_p : off_p + send_sizes[p]] with
    off = exclusive cumsum of send_sizes. Returns [capacity, ...]: the chunk from peer s at
    exclusive-cumsum(recv_sizes)[s], zeros after the last one.
    `ragged`: lax.ragged_all_to_all (GPU/TPU). `padded`: lax.all_to_all of [peers, chunk, ...]
    buffers with chunk = min(R, capacity) rows per peer, then compacted (any backend;
    peers x chunk rows of memory each way).
    """
    peers = send_sizes.shape[0]
    send_offsets = _exclusive_cumsum(send_sizes)
    out = jnp.zeros((capacity, *rows.shape[1:]), rows.dtype)
    if collective == "ragged":
        me = jax.lax.axis_index(AXIS)
        everyone = jax.lax.all_gather(send_sizes, AXIS)  # [source, destination]
        landing = (jnp.cumsum(everyone, axis=0) - everyone)[me]  # my chunk's offset at each peer
        return jax.lax.ragged_all_to_all(rows, out, send_offsets, send_sizes, landing,
                                         recv_sizes, axis_name=AXIS)
    if collective != "padded":
        raise ValueError(f"ep_collective: unknown collective {collective!r}")
    chunk = min(rows.shape[0], capacity)
    slot = jnp.arange(chunk)
    source_row = jnp.minimum(send_offsets[:, None] + slot, rows.shape[0] - 1)  # [peers, chunk]
    in_chunk = slot < send_sizes[:, None]
    padded = jnp.where(_expand(in_chunk, rows), rows[source_row], 0)
    received = jax.lax.all_to_all(padded, AXIS, 0, 0)  # received[s]: peer s's chunk for me
    target = jnp.where(slot < recv_sizes[:, None],
                       _exclusive_cumsum(recv_sizes)[:, None] + slot, capacity)
    return out.at[target.reshape(-1)].set(received.reshape(peers * chunk, *rows.shape[1:]),
                                          mode="drop")


def _expand(mask: jax.Array, like: jax.Array) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (like.ndim - 1))


def _local_experts(x, indices, combine_weights, gate, up, down, *, num_experts, clamp, impl,
                   block_size, collective, stat_axes):
    """Per-device body. x [n, D]; indices/combine_weights [n, k]; gate/up [E_loc, D, F]."""
    num_tokens, top_k = indices.shape
    local = gate.shape[0]
    peers = num_experts // local
    flat = indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert_sorted = flat[order]
    owner = expert_sorted // local
    send_sizes = jnp.bincount(owner, length=peers).astype(jnp.int32)
    recv_sizes = jax.lax.all_to_all(send_sizes, AXIS, 0, 0, tiled=True)

    copies = num_tokens * top_k
    capacity = peers * copies
    rows = exchange(x[order // top_k], send_sizes, recv_sizes, capacity, collective)
    # Local expert ids of the received rows; rows past the received ones are "no expert".
    ids = exchange(expert_sorted - owner * local, send_sizes, recv_sizes, capacity, collective)
    ids = jnp.where(jnp.arange(capacity) < jnp.sum(recv_sizes), ids, local)

    out, sums = MOE.resolve(impl)(rows, ids[:, None], ExpertWeights(gate, up, down), clamp,
                                  block_size)
    back = exchange(out[:, 0], recv_sizes, send_sizes, copies, collective)
    copy_out = jnp.zeros_like(back).at[order].set(back).reshape(num_tokens, top_k, -1)
    y = combine_copies(copy_out, combine_weights, x.dtype)
    # Each expert saw copies from its expert-axis group only; add the other groups'.
    if stat_axes:
        sums = merge_statistic_sums(sums, functools.partial(jax.lax.psum, axis_name=stat_axes),
                                    functools.partial(jax.lax.pmax, axis_name=stat_axes))
    return y, sums


def exchange_chunk(n: int, chunk: int) -> int:
    """Tokens per exchange of a device routing `n` tokens with model.moe.ep_chunk_tokens =
    `chunk`: the largest divisor of n not above it (0: all n)."""
    if not chunk or chunk >= n:
        return n
    return max(d for d in range(1, chunk + 1) if n % d == 0)


def _in_chunks(body, chunk: int):
    """`body`(x [n, D], indices, combine_weights, *weights) -> (y, sums), run on the tokens in
    chunks of the largest divisor of n not above `chunk` when 0 < chunk < n (module docstring)."""

    def run(x, indices, combine_weights, *weights):
        n = x.shape[0]
        size = exchange_chunk(n, chunk)
        if size == n:
            return body(x, indices, combine_weights, *weights)

        def one(part):
            return body(*part, *weights)

        split = lambda a: a.reshape(n // size, size, *a.shape[1:])  # noqa: E731
        y, sums = jax.lax.map(jax.checkpoint(one, prevent_cse=False),
                              (split(x), split(indices), split(combine_weights)))
        sums = merge_statistic_sums(sums, functools.partial(jnp.sum, axis=0),
                                    functools.partial(jnp.max, axis=0))
        return y.reshape(n, *y.shape[2:]), sums

    return run


def expert_parallel_experts(x, indices, combine_weights, weights: ExpertWeights, *,
                            clamp: SwiGLUClamp, impl: str, block_size: int, collective: str,
                            chunk: int = 0):
    """`model.layers.moe.routed_experts` with the experts spread over the mesh axis `expert`
    (under a mesh context and the logical-axis rules; see module docstring).
    x [N, D], indices/combine_weights [N, k] -> (y [N, D], per-expert stats dict of [E]).
    `chunk`: tokens per device per exchange (0: all of them at once)."""
    num_experts = weights.gate.shape[0]
    mesh = jax.sharding.get_abstract_mesh()
    peers = mesh.shape[AXIS]
    if num_experts % peers:
        raise ValueError(f"mesh.expert={peers} does not divide moe.num_experts={num_experts}")
    batch_axes = spec_axes(logical_spec("batch")[0])
    if AXIS not in batch_axes:
        if batch_axes:
            raise ValueError("expert parallelism needs the batch sharded over the `expert` axis "
                             f"or not at all (rules give {batch_axes})")
        return _experts_of_whole_tokens(x, indices, combine_weights, weights,
                                        logical_spec("batch", None), clamp=clamp, impl=impl,
                                        block_size=block_size)
    # x's N tokens: B rows over the batch axes, T over `context`; the MoE layer lists them
    # time-major under `context` (model/layers/moe.py)
    token_axes = (*(a for a in spec_axes(logical_spec("length")[0]) if mesh.shape[a] > 1),
                  *batch_axes)
    token_spec = P(token_axes, None)
    stat_axes = tuple(a for a in token_axes if a != AXIS and mesh.shape[a] > 1)
    body = functools.partial(
        _local_experts, num_experts=num_experts, clamp=clamp, impl=impl, block_size=block_size,
        collective=resolve_collective(collective), stat_axes=stat_axes)
    expert_spec = P(AXIS, None, None)
    # check_vma=False: the `sorted` path's loops start from zero buffers, not typed as varying
    # over the mesh; outputs and gradients are compared with the unsharded path in
    # tests/train/test_parallel.py.
    y, sums = jax.shard_map(
        _in_chunks(body, chunk),
        in_specs=(token_spec, token_spec, token_spec, expert_spec, expert_spec, expert_spec),
        out_specs=(token_spec, P(AXIS)), check_vma=False,
    )(x, indices, combine_weights, *weights)
    return y, finalize_statistics(sums, weights.gate.shape[-1])


def _own_experts(x, indices, combine_weights, gate, up, down, *, clamp, impl, block_size):
    """Per-device body when every device holds the same tokens. x [n, D]; indices /
    combine_weights [n, k]; gate/up [E_loc, D, F]. Copies routed to other devices' experts get
    the id "no expert" (no FLOPs in the `sorted` path) and weight 0; the psum adds theirs."""
    local = gate.shape[0]
    me = jax.lax.axis_index(AXIS)
    mine = indices // local == me
    ids = jnp.where(mine, indices - me * local, local)
    out, sums = MOE.resolve(impl)(x, ids, ExpertWeights(gate, up, down), clamp, block_size)
    y = combine_copies(out, jnp.where(mine, combine_weights, 0.0), jnp.float32)
    return jax.lax.psum(y, AXIS).astype(x.dtype), sums


def _experts_of_whole_tokens(x, indices, combine_weights, weights: ExpertWeights, token_spec, *,
                             clamp, impl, block_size):
    """`expert_parallel_experts` for tokens not sharded over `expert` (module docstring)."""
    body = functools.partial(_own_experts, clamp=clamp, impl=impl, block_size=block_size)
    expert_spec = P(AXIS, None, None)
    y, sums = jax.shard_map(
        body, in_specs=(token_spec, token_spec, token_spec, expert_spec, expert_spec, expert_spec),
        out_specs=(token_spec, P(AXIS)), check_vma=False,
    )(x, indices, combine_weights, *weights)
    return y, finalize_statistics(sums, weights.gate.shape[-1])
