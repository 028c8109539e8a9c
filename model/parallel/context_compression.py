"""DeepSeek-V4's compressed attention with the sequence split over `context` (report §3.5.3;
docs/parallelism.md, "Context parallelism"). Per shard, for each of its chunks of c tokens:

1. compression (`context_compress`): the chunk receives the uncompressed projections of the
   rows just before it (m - 1 for HCA; 2m - 1 for CSA, whose entries also pool the previous
   block; one collective permute, the report's "last m entries to the next rank") and pools
   every complete block whose last token is in the chunk. Blocks are aligned to document
   starts (model/ops/kv_compression.py), so a block may straddle two chunks: it belongs to
   the chunk of its last token, and a chunk completes at most ceil(c / m) blocks, padding
   included (the report's fixed s/m + 1 for blocks aligned to the sequence). The entries of
   all chunks are all-gathered and the valid ones selected, in order, into the N = T // m slots
   one device would hold: the same entries at the same slots, so CSA's top-k picks global
   slot indices.
2. attention (`context_compressed_attention`): queries attend to their window (the W - 1 rows
   before the chunk arrive by collective permute) and to the gathered entries visible at
   their token index (`CompressedKV.visible` with global indices).
3. the lightning indexer (`context_select_entries`, `context_dense_indexer_terms`): each shard
   scores its own queries against the gathered indexer keys; the dense warm-up's sums are
   added over the mesh.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model.ops.compressed_attention import compressed_attention
from model.ops.kv_compression import CompressedKV, CompressorParams, compress_rows, project_tokens
from model.ops.sparse_indexer import (
    DenseIndexerTerms,
    Selection,
    dense_indexer_sums,
    select_entries,
)
from model.parallel.context import AXIS, ContextLayout, token_spec
from model.parallel.context_attention import NO_SEGMENT
from model.parallel.mesh import logical_spec, spec_axes, tensor_heads


def _documents(segment_ids, rows: jax.Array) -> jax.Array:
    """segment_ids, or one document per row of `rows` [B, T, ...] when None."""
    return jnp.zeros(rows.shape[:2], jnp.int32) if segment_ids is None else segment_ids


def _specs():
    """PartitionSpec makers of arrays [B, T, ...] with T over `context` (`token_spec`) and of
    arrays [B, N, ...] whole on every context shard, both with B over the batch axes."""
    batch = logical_spec("batch")[0]
    return token_spec, lambda ndim: P(batch, *[None] * (ndim - 1))


def _fronts(front: jax.Array) -> jax.Array:
    """The rows before each slot [B, k, F, ...] -> [B·k, F, ...]."""
    return front.reshape(-1, *front.shape[2:])


def context_compress(hidden: jax.Array, params: CompressorParams, *, rate: int, overlap: bool,
                     inv_freq: jax.Array, segment_ids: jax.Array, positions: jax.Array,
                     eps: float, layout: ContextLayout) -> CompressedKV:
    """`model.ops.kv_compression.compress_kv` of a sequence split over `context`: hidden
    [B, T, d] (rows in layout order) -> CompressedKV of [B, T // rate] slots, whole on every
    shard."""
    kv, gate = project_tokens(hidden, params)  # token-wise, sharded as the rows
    segment_ids = _documents(segment_ids, hidden)
    rows, whole = _specs()
    length = hidden.shape[1]
    body = functools.partial(_compress_local, params=params, rate=rate, overlap=overlap,
                             inv_freq=inv_freq, eps=eps, layout=layout, length=length)
    out = CompressedKV(whole(3), whole(2), whole(2))
    return CompressedKV(*jax.shard_map(
        body, in_specs=(rows(3), rows(3), rows(2), rows(2)), out_specs=out, check_vma=False)(
        kv, gate, segment_ids, positions))


def _compress_local(kv, gate, segment_ids, positions, *, params, rate, overlap, inv_freq, eps,
                    layout: ContextLayout, length: int):
    batch, local_length = segment_ids.shape
    chunk = local_length // layout.slots
    halo = layout.halo((2 if overlap else 1) * rate - 1, length)
    offsets = layout.document_offsets(segment_ids)

    def extended(x, fill=0):
        return layout.with_previous_rows(x, halo, fill)

    first_row = layout.slot_starts(local_length) - halo
    per_chunk = -(-chunk // rate)
    local = compress_rows(extended(kv), extended(gate), extended(offsets, -1),
                          extended(segment_ids, NO_SEGMENT), extended(positions), params,
                          rate=rate, overlap=overlap, inv_freq=inv_freq, eps=eps,
                          slots=per_chunk, first_end=halo,
                          index_base=jnp.tile(first_row, batch), length=length)
    # [B·k, E] -> [B, k·E]: the shard's entries, then every shard's in natural order
    gathered = [layout.gather(x.reshape(batch, layout.slots * per_chunk, *x.shape[2:]))
                for x in local]
    return _select(CompressedKV(*gathered), length, length // rate)


def _select(entries: CompressedKV, length: int, slots: int) -> CompressedKV:
    """The valid entries (last token < T), in order, in the first of `slots` slots; the rest
    empty (value 0, last token T)."""
    valid = entries.last_token < length
    slot = jnp.where(valid, jnp.cumsum(valid, axis=1) - 1, slots)
    batch_rows = jnp.arange(valid.shape[0])[:, None]

    def place(x, fill):
        empty = jnp.full((x.shape[0], slots, *x.shape[2:]), fill, x.dtype)
        return empty.at[batch_rows, slot].set(x, mode="drop")

    return CompressedKV(place(entries.entries, 0), place(entries.last_token, length),
                        place(entries.segment_ids, NO_SEGMENT))


def context_compressed_attention(q, kv, compressed: CompressedKV, sink, *, layout: ContextLayout,
                                 window: int, segment_ids, query_chunk: int,
                                 selected=None, entry_probs: bool = False):
    """`model.ops.compressed_attention.compressed_attention` of a sequence split over
    `context`: q [B, T, H, c], kv [B, T, c], segment_ids [B, T] and `selected` [B, T, k] in
    layout order; `compressed` whole (`context_compress`). Heads over `tensor` when it divides
    them."""
    segment_ids = _documents(segment_ids, q)
    rows, whole = _specs()
    heads = tensor_heads(q.shape[2])
    q_spec = P(*rows(2), heads, None)
    args = [q, kv, segment_ids, sink, *compressed]
    specs = [q_spec, rows(3), rows(2), P(heads), whole(3), whole(2), whole(2)]
    if selected is not None:
        args.append(selected)
        specs.append(rows(3))
    body = functools.partial(_attend_local, layout=layout, window=window,
                             query_chunk=query_chunk, entry_probs=entry_probs,
                             length=q.shape[1])
    out_specs = (q_spec, rows(3)) if entry_probs else q_spec
    return jax.shard_map(body, in_specs=tuple(specs), out_specs=out_specs, check_vma=False)(*args)


def _attend_local(q, kv, segment_ids, sink, entries, last_token, entry_segments, selected=None, *,
                  layout: ContextLayout, window, query_chunk, entry_probs, length):
    batch, local_length = segment_ids.shape
    halo = layout.halo(window - 1, length)
    compressed = CompressedKV(*(jnp.repeat(x, layout.slots, axis=0)
                                for x in (entries, last_token, entry_segments)))
    first = jnp.tile(layout.slot_starts(local_length), batch)
    out = compressed_attention(
        layout.slot_rows(q), layout.slot_rows(kv), compressed, sink, window=window,
        segment_ids=layout.slot_rows(segment_ids),
        selected=None if selected is None else layout.slot_rows(selected),
        query_chunk=query_chunk, entry_probs=entry_probs, first_index=first,
        front=(_fronts(layout.previous_rows(kv, halo)),
               _fronts(layout.previous_rows(segment_ids, halo, NO_SEGMENT))))
    unslot = lambda x: x.reshape(batch, local_length, *x.shape[2:])  # noqa: E731
    return tuple(map(unslot, out)) if entry_probs else unslot(out)


def context_select_entries(queries, head_weights, keys: CompressedKV, segment_ids, *,
                           layout: ContextLayout, **options):
    """`model.ops.sparse_indexer.select_entries` of queries split over `context` (layout
    order) against the whole indexer keys: each shard picks its queries' top-k, as global
    slot indices. queries [B, T, H, c], head_weights [B, T, H], segment_ids [B, T]."""
    segment_ids = _documents(segment_ids, queries)
    rows, whole = _specs()

    def body(queries, head_weights, segment_ids, entries, last_token, entry_segments):
        index = jnp.broadcast_to(layout.token_index(segment_ids.shape[1]), segment_ids.shape)
        return select_entries(queries, head_weights, entries, index, last_token,
                              query_segment_ids=segment_ids, entry_segment_ids=entry_segments,
                              **options)

    return jax.shard_map(body, in_specs=(rows(4), rows(3), rows(2), whole(3), whole(2), whole(2)),
                         out_specs=Selection(rows(3), rows(3), rows(3)), check_vma=False)(
        queries, head_weights, segment_ids, *keys)


def context_dense_indexer_terms(queries, head_weights, keys: CompressedKV, target, segment_ids,
                                *, layout: ContextLayout, **options) -> DenseIndexerTerms:
    """`model.ops.sparse_indexer.dense_indexer_terms` of queries split over `context`: each
    shard sums its queries' terms, the sums are added over the whole mesh."""
    segment_ids = _documents(segment_ids, queries)
    rows, whole = _specs()
    split_over = (*spec_axes(logical_spec("batch")[0]), AXIS)  # the queries' axes

    def body(queries, head_weights, target, segment_ids, entries, last_token, entry_segments):
        index = jnp.broadcast_to(layout.token_index(segment_ids.shape[1]), segment_ids.shape)
        sums = dense_indexer_sums(queries, head_weights, entries, target, index, last_token,
                                  query_segment_ids=segment_ids,
                                  entry_segment_ids=entry_segments, **options)
        return tuple(jax.lax.psum(s, split_over) for s in sums)

    return DenseIndexerTerms.from_sums(*jax.shard_map(
        body, in_specs=(rows(4), rows(3), rows(3), rows(2), whole(3), whole(2), whole(2)),
        out_specs=(P(),) * 4, check_vma=False)(queries, head_weights, target, segment_ids, *keys))
