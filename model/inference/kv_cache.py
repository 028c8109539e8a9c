"""Key/value caches for incremental decoding (prefill, one-token steps, speculative verify).

Every attention layer keeps `key`/`value` [B, S, K, D] and the absolute `position` [B, S] of
each slot (-1 = empty); a token at position p lives in slot p mod S.
- Full layers: S = max_len, so slot = position.
- SWA layers: a ring of S = W + draft slots, whatever the context length (report 2.1: the
  window makes SWA cache memory constant). W would do for plain decoding; the `draft` extra
  slots hold the speculative tokens of a verify step, so a rejected draft never evicts a key that
  the next query still needs.

A chunk of T new tokens (T = 1 for a decode step, D + 1 for a speculative verify, a prompt
chunk for prefill) attends over [cache entries older than the chunk; the chunk itself] and is
then written. Entries at or after the chunk's first position are stale (drafts a verify step
rejected) and are ignored, so rolling back is free: the next chunk simply starts earlier.
Padding tokens carry position -1: they are neither attended to nor written.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from model.ops.attention_cores import masked_attention

_FAR = jnp.iinfo(jnp.int32).max


class KVCacheSpec(NamedTuple):
    """Static cache sizes: `max_len` tokens per row in total (prompt + generated + drafts) and
    `draft` speculative tokens verified per step (0 without speculation)."""

    max_len: int
    draft: int = 0

    def slots(self, window: int | None) -> int:
        """S of a layer: max_len for full attention, the W + draft ring for SWA."""
        return self.max_len if window is None else min(self.max_len, window + self.draft)


class LayerCache(NamedTuple):
    key: jax.Array  # [B, S, K, D]
    value: jax.Array  # [B, S, K, D]
    position: jax.Array  # [B, S] int32, -1 = empty


def empty_layer_cache(batch: int, slots: int, num_kv: int, head_dim: int, dtype) -> LayerCache:
    zeros = jnp.zeros((batch, slots, num_kv, head_dim), dtype)
    return LayerCache(zeros, zeros, jnp.full((batch, slots), -1, jnp.int32))


def attend_and_update(q, k, v, positions, cache: LayerCache, *, window: int | None,
                      sink: jax.Array | None) -> tuple[jax.Array, LayerCache]:
    """q: [B, T, H, D], k/v: [B, T, K, D] (RoPE applied), positions: [B, T] absolute, -1 for
    padding; valid tokens of a row must be consecutive positions. Returns the attention output
    [B, T, H, D] and the cache with the chunk written in."""
    valid = positions >= 0
    start = jnp.min(jnp.where(valid, positions, _FAR), axis=1)  # [B]
    end = jnp.max(jnp.where(valid, positions, -1), axis=1) + 1  # [B] one past the last token
    older = jnp.where(cache.position < start[:, None], cache.position, -1)
    key_pos = jnp.concatenate([older, jnp.where(valid, positions, -1)], axis=1)  # [B, S + T]
    query_pos = positions[:, :, None]
    mask = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= query_pos)
    if window is not None:
        mask &= query_pos - key_pos[:, None, :] < window
    keys = jnp.concatenate([cache.key, k.astype(cache.key.dtype)], axis=1)
    values = jnp.concatenate([cache.value, v.astype(cache.value.dtype)], axis=1)
    out = masked_attention(q, keys.astype(q.dtype), values.astype(q.dtype), mask, sink)
    return out, write_chunk(cache, k, v, positions, end)


def write_chunk(cache: LayerCache, k, v, positions, end) -> LayerCache:
    """Writes the chunk's valid tokens into their slots. Only the last S positions of a row
    (those >= end - S) are written, so no two writes of a row share a slot."""
    slots = cache.key.shape[1]
    keep = (positions >= 0) & (positions >= (end - slots)[:, None])
    slot = jnp.where(keep, positions % slots, slots)  # out of range: dropped
    rows = jnp.arange(positions.shape[0])[:, None]

    def put(buffer, new):
        return buffer.at[rows, slot].set(new.astype(buffer.dtype), mode="drop")

    return LayerCache(put(cache.key, k), put(cache.value, v), put(cache.position, positions))
