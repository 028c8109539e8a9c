"""Decode caches of DeepSeek-V4's shared-KV attention layers (W, C, H; report §2.3), with the
position rules of `model.inference.kv_cache`: every slot records the absolute position it
holds (-1 = empty), a chunk of new tokens sees only what precedes its first position, and
whatever lies at or after it is stale (drafts a verify step rejected), so rollback is free.

- `WindowCache`: the sliding-window branch, a ring of W + draft slots holding each token's one
  shared entry (K = V, stored once).
- `CompressorCache` (C / H layers, and the CSA lightning indexer's keys):
  * `entries` [B, max_len // m, c]: compressed entry w in slot w, with `entry_last` the
    position of its block's last token (-1 = not complete yet). Slot w = entry w keeps the
    order of the training path's entries, so the indexer's top-k breaks ties alike.
  * a tail ring of the per-token projections (kv, gate logits before pooling) of the latest
    tokens: m for H, 2m for C's overlapped pooling (block w also pools block w-1), plus draft
    slots. An entry completes when its block's last token arrives, in whatever chunk (a
    prefill chunk that splits a block, a one-token step, a verify chunk), from the tail and
    the chunk; an entry ending at or after the chunk's first position is recomputed.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from model.inference.kv_cache import (
    FAR,
    KVCacheSpec,
    cache_variables,
    causal_mask,
    chunk_bounds,
    chunk_key_positions,
    ring_write,
)
from model.inference.kv_storage import RowFormat
from model.ops.kv_compression import CompressorParams, pool_blocks, project_tokens


class WindowCache(NamedTuple):
    window_kv: jax.Array  # [B, S, c] one entry per token: key and value (or its RowFormat form)
    window_position: jax.Array  # [B, S] int32, -1 = empty


def empty_window_cache(batch: int, spec: KVCacheSpec, window: int, width: int, dtype,
                       fmt: RowFormat = RowFormat()) -> WindowCache:
    slots = spec.slots(window)
    return WindowCache(fmt.empty((batch, slots, width), dtype),
                       jnp.full((batch, slots), -1, jnp.int32))


def window_keys(cache: WindowCache, kv: jax.Array, positions: jax.Array, window: int,
                fmt: RowFormat = RowFormat()) -> tuple[jax.Array, jax.Array, WindowCache]:
    """kv [B, T, c] (roped) of a chunk at positions [B, T] (-1 = padding) -> (keys [B, S + T, c]:
    older cache entries then the chunk, as stored in `fmt`; their mask [B, T, S + T] (causal
    within the window); the cache with the chunk written in)."""
    start, end = chunk_bounds(positions)
    mask = causal_mask(chunk_key_positions(cache.window_position, positions, start), positions,
                       window)
    stored = fmt.encode(kv)
    keys = jnp.concatenate([fmt.decode(cache.window_kv, kv.dtype), fmt.decode(stored, kv.dtype)],
                           axis=1)
    written = WindowCache(ring_write(cache.window_kv, stored, positions, end),
                          ring_write(cache.window_position, positions, positions, end))
    return keys, mask, written


class CompressorCache(NamedTuple):
    tail_kv: jax.Array  # [B, R, F] per-token projections, F = c (HCA) or 2c (CSA)
    tail_gate: jax.Array  # [B, R, F] float32 gate logits before the slot bias
    tail_position: jax.Array  # [B, R] int32, -1 = empty
    entries: jax.Array  # [B, N, c] compressed entry w in slot w (or its RowFormat form)
    entry_last: jax.Array  # [B, N] int32 position of the entry's last token, -1 = none


def empty_compressor_cache(batch: int, spec: KVCacheSpec, rate: int, overlap: bool, width: int,
                           dtype, entry_format: RowFormat = RowFormat()) -> CompressorCache:
    """R = (2 if overlap else 1)·rate + draft: an entry completing in a chunk that starts at s
    reads tokens from s - 2m + 1 (CSA) on, and s may be up to `draft` before the last written
    position (rejected drafts). N = max_len // rate entries, stored in `entry_format`."""
    features = 2 * width if overlap else width
    tail = (2 if overlap else 1) * rate + spec.draft
    num = spec.max_len // rate
    return CompressorCache(jnp.zeros((batch, tail, features), dtype),
                           jnp.zeros((batch, tail, features), jnp.float32),
                           jnp.full((batch, tail), -1, jnp.int32),
                           entry_format.empty((batch, num, width), dtype),
                           jnp.full((batch, num), -1, jnp.int32))


def _gather_positions(values: jax.Array, value_pos: jax.Array, first: jax.Array,
                      rate: int) -> jax.Array:
    """values [B, K, F] at positions value_pos [B, K] (unique, -1 = none) -> [B, N, rate, F]:
    the values at positions first..first+rate-1 for first [B, N] (garbage where absent)."""
    batch, num = first.shape
    wanted = (first[:, :, None] + jnp.arange(rate)).reshape(batch, -1)
    index = jnp.argmax(wanted[:, :, None] == value_pos[:, None, :], axis=-1)
    gathered = jnp.take_along_axis(values, index[:, :, None], axis=1)
    return gathered.reshape(batch, num, rate, values.shape[-1])


def compress_chunk(cache: CompressorCache, params: CompressorParams, hidden: jax.Array,
                   positions: jax.Array, *, rate: int, overlap: bool, inv_freq: jax.Array,
                   eps: float, entry_format: RowFormat = RowFormat()) -> CompressorCache:
    """hidden [B, T, d] of a chunk at positions [B, T] (-1 = padding) -> the cache with the
    chunk's projections in the tail and every entry whose block ends in the chunk (re)computed
    as `model.ops.kv_compression.compress_kv` computes it from the whole sequence (and stored
    in `entry_format`)."""
    batch, length, _ = hidden.shape
    kv, gate = project_tokens(hidden, params)
    start, end = chunk_bounds(positions)
    base = jnp.where(end > 0, start, 0)  # rows without tokens complete nothing
    value_pos = chunk_key_positions(cache.tail_position, positions, start)  # [B, R + T]
    all_kv = jnp.concatenate([cache.tail_kv, kv.astype(cache.tail_kv.dtype)], axis=1)
    all_gate = jnp.concatenate([cache.tail_gate, gate], axis=1)
    # Candidates: the entries whose last token (w + 1)·m - 1 may fall in [start, end).
    entry = base[:, None] // rate + jnp.arange(length // rate + 1)  # [B, n]
    first = entry * rate
    complete = first + rate - 1 < end[:, None]
    previous = None
    if overlap:  # §2.3.1: entry w also pools block w-1's first c channels (none for w = 0)
        previous = (_gather_positions(all_kv, value_pos, first - rate, rate),
                    _gather_positions(all_gate, value_pos, first - rate, rate), first >= rate)
    pooled = pool_blocks(_gather_positions(all_kv, value_pos, first, rate),
                         _gather_positions(all_gate, value_pos, first, rate), previous, first,
                         params, inv_freq=inv_freq, eps=eps)
    num = cache.entry_last.shape[1]
    slot = jnp.where(complete, entry, num)  # out of range: dropped
    rows = jnp.arange(batch)[:, None]
    stale = cache.entry_last >= start[:, None]
    entry_last = jnp.where(stale, -1, cache.entry_last).at[rows, slot].set(
        first + rate - 1, mode="drop")
    entries = jax.tree.map(lambda old, new: old.at[rows, slot].set(new.astype(old.dtype),
                                                                   mode="drop"),
                           cache.entries, entry_format.encode(pooled))
    return CompressorCache(ring_write(cache.tail_kv, kv, positions, end),
                           ring_write(cache.tail_gate, gate, positions, end),
                           ring_write(cache.tail_position, positions, positions, end),
                           entries, entry_last)


def entry_ends(cache: CompressorCache) -> jax.Array:
    """[B, N] position of each entry's last token, FAR for slots without an entry: query t
    sees entry w iff entry_ends[w] <= t (as the training path, the block ending at t
    included)."""
    return jnp.where(cache.entry_last >= 0, cache.entry_last, FAR)


def entry_visibility(cache: CompressorCache, positions: jax.Array) -> jax.Array:
    """positions [B, T] (-1 = padding, sees nothing) -> bool [B, T, N]."""
    return entry_ends(cache)[:, None, :] <= positions[:, :, None]


def cached_compression(module, params: CompressorParams, hidden: jax.Array,
                       positions: jax.Array, spec: KVCacheSpec, *, rate: int, overlap: bool,
                       inv_freq: jax.Array, eps: float,
                       entry_format: RowFormat = RowFormat()) -> CompressorCache:
    """`compress_chunk` on the CompressorCache held in flax `module`'s `cache` collection
    (created empty on first use); returns the updated cache."""
    empty = empty_compressor_cache(hidden.shape[0], spec, rate, overlap,
                                   params.kv_norm.shape[0], hidden.dtype, entry_format)
    cache, store = cache_variables(module, empty)
    updated = compress_chunk(cache, params, hidden, positions, rate=rate, overlap=overlap,
                             inv_freq=inv_freq, eps=eps, entry_format=entry_format)
    store(updated)
    return updated
