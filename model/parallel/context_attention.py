"""GQA attention with the sequence split over the mesh axis `context` (docs/parallelism.md,
"Context parallelism"), per layer kind:

- sliding-window layers: a chunk's queries need only the W - 1 rows before the chunk. They
  arrive by collective permute (`ContextLayout.previous_rows`: ceil((W-1)/c) hops when the
  window reaches past the previous chunk), so the exchange does not grow with T. The attention
  core (any `attention_impl`: XLA, cuDNN, Pallas) then runs per shard on the chunk with its
  halo in front: queries [halo; chunk] (the halo's query rows are zeros and their outputs are
  dropped), keys and values [halo; chunk]; the halo's rows keep their segment ids, rows before
  the sequence get one no query has.
- full-attention layers: K, V and segment ids are all-gathered over `context` (GQA's few KV
  heads make them small next to the queries); each chunk's queries attend to the keys up to
  the chunk's natural end, masked by natural index and document. Under the balanced layout a
  shard's first chunk (r < C) needs only the first half of the keys, its second all of them.
  This runs the `xla` masked attention in query blocks whatever `attention_impl` says: the
  kernels' causal masks are by local row and cannot place queries at an offset.

Shapes as `model.ops.attention_cores`: q [B, T, H, D], k [B, T, K, D], v [B, T, K, Dv] ->
[B, T, H, Dv], rows in layout order (`model.parallel.context`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model.ops.attention_cores import AttentionCore, masked_attention
from model.parallel.context import AXIS, ContextLayout, token_spec
from model.parallel.mesh import logical_spec, tensor_heads

NO_SEGMENT = jnp.iinfo(jnp.int32).min  # the segment id of rows before the sequence
SCORES_PER_BLOCK = 1 << 22  # scores (rows x keys x heads) per query block of a gathered layer


def context_attention(core: AttentionCore, layout: ContextLayout) -> AttentionCore:
    """`core` on the sequence split over `context` (module docstring); batch over the rules'
    batch axes, heads over `tensor` when it divides the query and KV heads."""

    def sharded(q, k, v, *, window, segment_ids, sink):
        heads = tensor_heads(q.shape[2], k.shape[2])
        qkv, rows = P(logical_spec("batch")[0], AXIS, heads, None), token_spec(2)
        if segment_ids is None:
            segment_ids = jnp.zeros(q.shape[:2], jnp.int32)
        args, specs = [q, k, v, segment_ids], [qkv, qkv, qkv, rows]
        if sink is not None:
            args.append(sink)
            specs.append(P(heads))
        length = q.shape[1]
        if window is None:
            local = functools.partial(_gathered, layout=layout)
        else:
            local = functools.partial(_windowed, core=core, layout=layout, window=window,
                                      length=length)
        return jax.shard_map(local, in_specs=tuple(specs), out_specs=qkv, check_vma=False)(*args)

    return sharded


def _windowed(q, k, v, seg, sink=None, *, core, layout: ContextLayout, window: int, length: int):
    """Per shard: each chunk with the W - 1 rows before it (at most those of the chunks before
    it), through `core`. q/k/v [B, L, ., .] local."""
    batch, local_length = q.shape[:2]
    count = layout.halo(window - 1, length)
    widths = [(0, 0), (count, 0)] + [(0, 0)] * (q.ndim - 2)
    queries = jnp.pad(layout.slot_rows(q), widths)  # zero query rows for the halo
    out = core(queries, layout.with_previous_rows(k, count),
               layout.with_previous_rows(v, count), window=window,
               segment_ids=layout.with_previous_rows(seg, count, NO_SEGMENT), sink=sink)
    return out[:, count:].reshape(batch, local_length, *out.shape[2:])


def _gathered(q, k, v, seg, sink=None, *, layout: ContextLayout):
    """Per shard: each chunk's queries against the all-gathered keys up to the chunk's end."""
    batch, local_length = q.shape[:2]
    chunk = local_length // layout.slots
    index = layout.token_index(local_length).reshape(layout.slots, chunk)
    keys, values, key_seg = (layout.gather(x) for x in (k, v, seg))
    total = keys.shape[1]
    outs = []
    for j in range(layout.slots):
        # the balanced layout's slot 0 holds chunk r < C: its keys end by the middle
        extent = total // 2 if layout.slots == 2 and j == 0 else total
        part = slice(j * chunk, (j + 1) * chunk)
        outs.append(gathered_attention(q[:, part], keys[:, :extent], values[:, :extent],
                                       index[j], seg[:, part], key_seg[:, :extent], sink))
    return jnp.concatenate(outs, axis=1)


def gathered_attention(q, k, v, q_index, q_seg, k_seg, sink):
    """Causal attention of queries at natural indices `q_index` [Q] over keys 0..S-1:
    q [B, Q, H, D], k [B, S, K, D], v [B, S, K, Dv], q_seg [B, Q], k_seg [B, S], sink [H] or
    None -> [B, Q, H, Dv]. Query blocks run one after another and are rematerialised in the
    backward pass, so one block's [rows, S] scores are live at a time."""
    batch, queries = q.shape[:2]
    keys = k.shape[1]
    rows = max(1, min(queries, SCORES_PER_BLOCK // (keys * q.shape[2])))
    blocks = -(-queries // rows)
    pad = blocks * rows - queries

    def padded(x, fill):
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, pad)
        x = jnp.pad(x, widths, constant_values=fill)
        return jnp.moveaxis(x.reshape(batch, blocks, rows, *x.shape[2:]), 1, 0)

    def block(xs):
        q_b, seg_b, index_b = xs
        return _causal_block(q_b, k, v, sink, index_b, seg_b, k_seg)

    index = jnp.broadcast_to(q_index, (batch, queries))
    out = jax.lax.map(block, (padded(q, 0), padded(q_seg, NO_SEGMENT), padded(index, -1)))
    return jnp.moveaxis(out, 0, 1).reshape(batch, blocks * rows, *out.shape[3:])[:, :queries]


def _block_mask(q_index, q_seg, k_seg):
    """Query t (natural index q_index [B, Q]) sees key s <= t of its document: [B, Q, S]."""
    key_index = jnp.arange(k_seg.shape[1])
    return (key_index[None, None, :] <= q_index[:, :, None]) & (
        q_seg[:, :, None] == k_seg[:, None, :])


@jax.custom_vjp
def _causal_block(q, k, v, sink, q_index, q_seg, k_seg):
    """One query block of `gathered_attention`. Its mask is built from the indices in the
    forward pass and again in the backward (which recomputes the block), never stored: as a
    residual of the loop it would be stacked over all the blocks ([T, T] bits per layer)."""
    return masked_attention(q, k, v, _block_mask(q_index, q_seg, k_seg), sink)


def _causal_block_fwd(q, k, v, sink, q_index, q_seg, k_seg):
    return _causal_block(q, k, v, sink, q_index, q_seg, k_seg), (q, k, v, sink, q_index, q_seg,
                                                                 k_seg)


def _causal_block_bwd(residuals, d_out):
    q, k, v, sink, q_index, q_seg, k_seg = residuals
    mask = _block_mask(q_index, q_seg, k_seg)
    _, vjp = jax.vjp(lambda q, k, v, sink: masked_attention(q, k, v, mask, sink), q, k, v, sink)
    return (*vjp(d_out), None, None, None)


_causal_block.defvjp(_causal_block_fwd, _causal_block_bwd)
