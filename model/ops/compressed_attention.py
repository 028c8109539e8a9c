"""The core attention of DeepSeek-V4's compressed layers (report §2.3.1 eq. 19, §2.3.2 eq. 26,
§2.3.3): shared-KV MQA (one KV head; each entry is both key and value) over
(a) compressed entries (`model.ops.kv_compression.CompressedKV`): all visible ones (HCA) or a
    per-query selection (CSA: the lightning indexer's top-k), and
(b) the sliding window of raw entries: query i sees tokens j of its document with
    i - W < j <= i (W entries including itself, Hugging Face's sliding-window mask),
with a per-head learnable sink logit in the softmax denominator (eq. 27) and softmax scale
1/sqrt(c), softmax in float32. As upstream, tokens covered both by the window and by a visible
compressed entry are attended through both (no deduplication).

Cost O(T·(N + 2C)) for N = T // m compressed slots and query chunks of C >= W rows: chunk n
attends to the raw entries of chunks n-1 and n (which cover every window) and to the
compressed entries; no [T, T] array is formed. Chunks run one after another (`lax.map`) and
are rematerialised in the backward pass, so live memory is one chunk's scores.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from model.ops.kv_compression import CompressedKV
from pallas_kernels.target import target_backend

_NEG = -1e30  # finite "-inf": a fully masked row yields zeros (sink only), gradients stay finite
QUERY_CHUNK = 128  # default query rows per chunk (raised to the window when W is larger)
# CSA queries per block within a chunk (`_selected_in_row_blocks`), per backend; others take
# the whole chunk at once
SELECTED_ROWS = {"cpu": 16}


def _chunk_rows(x: jax.Array, chunk: int, pad_value=0) -> jax.Array:
    """[B, T, ...] -> [B, T', ...] with T' the next multiple of `chunk`."""
    pad = -x.shape[1] % chunk
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, constant_values=pad_value)


def compressed_attention(q: jax.Array, kv: jax.Array, compressed: CompressedKV, sink: jax.Array,
                         *, window: int, segment_ids: jax.Array | None = None,
                         selected: jax.Array | None = None,
                         query_chunk: int = QUERY_CHUNK,
                         entry_probs: bool = False,
                         front: tuple[jax.Array, jax.Array] | None = None,
                         first_index: jax.Array | None = None):
    """q: [B, T, H, c] (normed, roped queries); kv: [B, T, c] raw sliding-window entries;
    compressed: entries [B, N, c]; sink: [H] logits; window: W >= 1; segment_ids: [B, T]
    (None: one document per row); selected: [B, T, k] int indices into the N compressed slots,
    -1 for none (CSA; must be distinct per query) or None (HCA: every visible entry)
    -> [B, T, H, c] in q.dtype; with `entry_probs` also the attention probability of each
    compressed slot summed over heads, [B, T, k] (CSA) or [B, T, N] (HCA) float32 without
    gradient (the lightning indexer's training target).

    An entry is attended only if `compressed.visible` (complete before the query, same
    document), whatever `selected` says, so an indexer's stray picks are harmless.
    A piece of a longer sequence (a context shard, model/parallel/context_compression.py)
    gives `front`: the raw entries [B, F, c] and segment ids [B, F] of the F rows before its
    first query (F <= W - 1), and `first_index` [B]: its first query's token index.
    """
    batch, length, heads, dim = q.shape
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, length), jnp.int32)
    chunk = min(max(window, query_chunk), length)
    q_p = _chunk_rows(q, chunk)
    num_chunks = q_p.shape[1] // chunk
    seg_p = _chunk_rows(segment_ids, chunk, pad_value=-1)  # padding rows match no real key
    # Raw keys of chunk n: the `before` rows ahead of it (chunk n-1, or what comes before the
    # first chunk) and the chunk itself; zero rows of segment -1 where there are none.
    before = chunk if front is None else max(chunk, front[0].shape[1])
    front_kv, front_seg = ((kv[:, :0], segment_ids[:, :0]) if front is None else front)
    kv_front = jnp.concatenate([_front_pad(front_kv, before, 0), _chunk_rows(kv, chunk)], 1)
    seg_front = jnp.concatenate([_front_pad(front_seg, before, -1), seg_p], 1)
    first_index = jnp.zeros((batch,), jnp.int32) if first_index is None else first_index
    if selected is not None:
        selected = _chunk_rows(selected, chunk, pad_value=-1)

    def one_chunk(n):
        start = n * chunk
        q_c = jax.lax.dynamic_slice_in_dim(q_p, start, chunk, axis=1)  # [B, C, H, c]
        seg_q = jax.lax.dynamic_slice_in_dim(seg_p, start, chunk, axis=1)  # [B, C]
        k_win = jax.lax.dynamic_slice_in_dim(kv_front, start, before + chunk, axis=1)
        seg_k = jax.lax.dynamic_slice_in_dim(seg_front, start, before + chunk, axis=1)
        q_pos = start + jnp.arange(chunk)
        k_pos = start - before + jnp.arange(before + chunk)
        distance = q_pos[:, None] - k_pos[None, :]
        win_mask = ((distance >= 0) & (distance < window))[None] & (
            seg_q[:, :, None] == seg_k[:, None, :])  # [B, C, F + C]
        visible = compressed.visible(first_index[:, None] + q_pos, seg_q)  # [B, C, N]
        if selected is None:
            return attend_window_and_entries(q_c, k_win, win_mask, compressed.entries, visible,
                                             sink)
        picks = jax.lax.dynamic_slice_in_dim(selected, start, chunk, axis=1)  # [B, C, k]
        return _selected_in_row_blocks(q_c, k_win, win_mask, compressed.entries, visible, sink,
                                       picks)

    outs, summed = jax.lax.map(jax.checkpoint(one_chunk), jnp.arange(num_chunks))
    outs = jnp.moveaxis(outs, 0, 1).reshape(batch, num_chunks * chunk, heads, dim)[:, :length]
    if not entry_probs:
        return outs
    summed = jnp.moveaxis(summed, 0, 1)  # [B, n, C, N or k]
    return outs, summed.reshape(batch, num_chunks * chunk, -1)[:, :length]


def _front_pad(rows: jax.Array, count: int, fill) -> jax.Array:
    """[B, F, ...] -> [B, count, ...]: `fill` rows in front of `rows` (F <= count)."""
    widths = [(0, 0)] * rows.ndim
    widths[1] = (count - rows.shape[1], 0)
    return jnp.pad(rows, widths, constant_values=fill)


def _selected_in_row_blocks(q, window_keys, window_mask, entries, visible, sink, selected):
    """`attend_window_and_entries` of a CSA query chunk, SELECTED_ROWS queries at a time (a
    divisor of the chunk), rematerialised: on CPU the per-query gathered entries [rows, k, c]
    stay in cache instead of [C, k, c] streaming through memory (fwd+bwd of a 128-query chunk
    with k = 512, c = 128, H = 8 on XLA:CPU: 2.5x faster in blocks of 8-16). Accelerators take
    the whole chunk in one block: a loop of small steps there costs kernel launches, while
    the chunk's gather ([C, k, c], 64 MiB at C = 128, k = c = 512 in bfloat16) fits memory."""
    rows = math.gcd(q.shape[1], SELECTED_ROWS.get(target_backend(), q.shape[1]))

    def block(i):
        def part(x):
            return jax.lax.dynamic_slice_in_dim(x, i * rows, rows, axis=1)
        return attend_window_and_entries(part(q), window_keys, part(window_mask), entries,
                                         part(visible), sink, part(selected))

    outs, summed = jax.lax.map(jax.checkpoint(block), jnp.arange(q.shape[1] // rows))

    def merged(x):  # [n, B, rows, ...] -> [B, n·rows, ...]
        return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])

    return merged(outs), merged(summed)


def attend_window_and_entries(q: jax.Array, window_keys: jax.Array, window_mask: jax.Array,
                              entries: jax.Array, visible: jax.Array, sink: jax.Array,
                              selected: jax.Array | None = None):
    """The shared-KV attention of Q queries over raw window entries and compressed entries,
    each entry its own value: q [B, Q, H, c]; window_keys [B, K, c] seen where window_mask
    [B, Q, K]; entries [B, N, c] seen where visible [B, Q, N], all of them (HCA) or only the
    `selected` [B, Q, k] slots (CSA, -1 = none); sink [H] logits -> (out [B, Q, H, c] in
    q.dtype, attention probability of each compressed slot summed over heads [B, Q, N or k]
    float32, without gradient). Used by the training path (per query chunk) and by decoding
    (over the caches)."""
    scale = q.shape[-1] ** -0.5
    sink = sink.astype(jnp.float32)
    win_logits = jnp.einsum("bqhd,bkd->bqhk", q, window_keys,
                            preferred_element_type=jnp.float32) * scale
    if selected is None:
        comp_keys, comp_mask = entries, visible  # [B, N, c], [B, Q, N]
        pattern = "bqhn,bnd->bqhd"
        comp_logits = jnp.einsum("bqhd,bnd->bqhn", q, comp_keys,
                                 preferred_element_type=jnp.float32) * scale
    else:
        safe = jnp.clip(selected, 0, entries.shape[1] - 1)
        comp_mask = (selected >= 0) & jnp.take_along_axis(visible, safe, axis=2)
        comp_keys = jnp.take_along_axis(entries[:, None], safe[..., None], axis=2)  # [B, Q, k, c]
        pattern = "bqhk,bqkd->bqhd"
        comp_logits = jnp.einsum("bqhd,bqkd->bqhk", q, comp_keys,
                                 preferred_element_type=jnp.float32) * scale
    logits = jnp.concatenate([jnp.where(window_mask[:, :, None], win_logits, _NEG),
                              jnp.where(comp_mask[:, :, None], comp_logits, _NEG)], axis=-1)
    # eq. 27: exp(sink_h) joins the denominator; the sink has no value vector.
    top = jnp.maximum(jnp.max(logits, axis=-1), sink)  # [B, Q, H]
    weights = jnp.exp(logits - top[..., None])
    denom = jnp.sum(weights, axis=-1) + jnp.exp(sink - top)
    probs = (weights / denom[..., None]).astype(window_keys.dtype)
    num_window = window_keys.shape[1]
    win_probs, comp_probs = probs[..., :num_window], probs[..., num_window:]
    out = jnp.einsum("bqhk,bkd->bqhd", win_probs, window_keys, preferred_element_type=jnp.float32)
    out = out + jnp.einsum(pattern, comp_probs, comp_keys, preferred_element_type=jnp.float32)
    summed = jax.lax.stop_gradient(jnp.sum(comp_probs.astype(jnp.float32), axis=2))
    return out.astype(q.dtype), summed
