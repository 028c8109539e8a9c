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

`KVCacheSpec.fp8` stores keys and values in DeepSeek-V4's FP8 layout, RoPE channels unquantized
(model/inference/kv_storage.py); every key or value read, the chunk's own included, is then the
stored one.
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from model.inference.kv_storage import RowFormat
from model.ops.attention_cores import masked_attention

FAR = jnp.iinfo(jnp.int32).max  # a position after every real one (rows without tokens)


class KVCacheSpec(NamedTuple):
    """Static cache sizes: `max_len` tokens per row in total (prompt + generated + drafts) and
    `draft` speculative tokens verified per step (0 without speculation); `fp8`: keys and
    values (DeepSeek-V4: the window and compressed entries) stored in FP8 but their RoPE
    channels (`kv_storage.RowFormat`)."""

    max_len: int
    draft: int = 0
    fp8: bool = False

    def row_format(self, rope: tuple[int, int] = (0, 0)) -> RowFormat:
        """How rows whose RoPE channels are [rope[0], rope[1]) are stored."""
        return RowFormat(self.fp8, rope)

    def slots(self, window: int | None) -> int:
        """S of a layer: max_len for full attention, the W + draft ring for SWA."""
        return self.max_len if window is None else min(self.max_len, window + self.draft)


class LayerCache(NamedTuple):
    key: jax.Array  # [B, S, K, D] (or its `RowFormat` form)
    value: jax.Array  # [B, S, K, Dv] (likewise)
    position: jax.Array  # [B, S] int32, -1 = empty


def empty_layer_cache(batch: int, slots: int, num_kv: int, head_dim: int, dtype, *,
                      v_head_dim: int | None = None,
                      formats: tuple[RowFormat, RowFormat] = (RowFormat(), RowFormat())
                      ) -> LayerCache:
    """Empty slots for keys of `head_dim` and values of `v_head_dim` (default: `head_dim`),
    stored in `formats` (keys', values')."""
    keys = formats[0].empty((batch, slots, num_kv, head_dim), dtype)
    values = formats[1].empty((batch, slots, num_kv, v_head_dim or head_dim), dtype)
    return LayerCache(keys, values, jnp.full((batch, slots), -1, jnp.int32))


def chunk_bounds(positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] (-1 = padding) -> (first position [B], one past the last [B]); a row
    without tokens has start FAR and end 0, so it invalidates and writes nothing."""
    valid = positions >= 0
    start = jnp.min(jnp.where(valid, positions, FAR), axis=1)
    end = jnp.max(jnp.where(valid, positions, -1), axis=1) + 1
    return start, end


def chunk_key_positions(cache_position: jax.Array, positions: jax.Array,
                        start: jax.Array) -> jax.Array:
    """Positions of [cache entries older than the chunk; the chunk] as keys, -1 for empty or
    stale slots and padding: [B, S], [B, T], [B] -> [B, S + T]."""
    older = jnp.where(cache_position < start[:, None], cache_position, -1)
    return jnp.concatenate([older, jnp.where(positions >= 0, positions, -1)], axis=1)


def causal_mask(key_pos: jax.Array, positions: jax.Array, window: int | None) -> jax.Array:
    """Query t sees key j iff 0 <= j <= t (and t - j < window): [B, K], [B, T] -> bool [B, T, K]."""
    query_pos = positions[:, :, None]
    mask = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= query_pos)
    if window is not None:
        mask &= query_pos - key_pos[:, None, :] < window
    return mask


def attend_and_update(q, k, v, positions, cache: LayerCache, *, window: int | None,
                      sink: jax.Array | None,
                      formats: tuple[RowFormat, RowFormat] = (RowFormat(), RowFormat())
                      ) -> tuple[jax.Array, LayerCache]:
    """q: [B, T, H, D], k: [B, T, K, D] (RoPE applied), v: [B, T, K, Dv], positions: [B, T]
    absolute, -1 for padding; valid tokens of a row must be consecutive positions; `formats`:
    the cache's (keys', values'). Returns the attention output [B, T, H, Dv] and the cache with
    the chunk written in."""
    start, end = chunk_bounds(positions)
    mask = causal_mask(chunk_key_positions(cache.position, positions, start), positions, window)
    k, v = formats[0].encode(k), formats[1].encode(v)
    keys, values = (jnp.concatenate([f.decode(old, q.dtype), f.decode(new, q.dtype)], axis=1)
                    for f, old, new in zip(formats, (cache.key, cache.value), (k, v)))
    out = masked_attention(q, keys, values, mask, sink)
    return out, write_chunk(cache, k, v, positions, end)


def ring_write(buffer, new, positions: jax.Array, end: jax.Array):
    """Writes the chunk's valid tokens new [B, T, ...] into slot position mod S of buffer
    [B, S, ...] (or of each array of a stored form, `kv_storage.Fp8Rows`). Only the last S
    positions of a row (those >= end - S) are written, so no two writes of a row share a
    slot."""
    slots = jax.tree.leaves(buffer)[0].shape[1]
    keep = (positions >= 0) & (positions >= (end - slots)[:, None])
    slot = jnp.where(keep, positions % slots, slots)  # out of range: dropped
    rows = jnp.arange(positions.shape[0])[:, None]
    return jax.tree.map(lambda old, chunk: old.at[rows, slot].set(chunk.astype(old.dtype),
                                                                  mode="drop"), buffer, new)


def write_chunk(cache: LayerCache, k, v, positions, end) -> LayerCache:
    """The chunk's keys, values (in the cache's stored form) and positions written into their
    ring slots."""
    return LayerCache(*(ring_write(buffer, new, positions, end)
                        for buffer, new in zip(cache, (k, v, positions))))


def cache_variables(module, empty: NamedTuple) -> tuple[NamedTuple, Callable]:
    """The `cache` collection variables of flax `module` named after the fields of `empty`
    (their initial values) -> (current state, store(new state))."""
    variables = [module.variable("cache", name, lambda value=value: value)
                 for name, value in zip(empty._fields, empty)]

    def store(state: NamedTuple) -> None:
        for variable, value in zip(variables, state):
            variable.value = value

    return type(empty)(*(variable.value for variable in variables)), store
