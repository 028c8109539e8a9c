"""Context parallelism: one sequence split over the mesh axis `context` (docs/parallelism.md,
"Context parallelism").

A sequence of T tokens is cut into C·k chunks of c = T / (C·k) consecutive tokens, C the size
of `context`; each shard holds k chunk slots (`ContextLayout`):
- contiguous (k = 1): shard r holds chunk r;
- balanced (k = 2): shard r holds chunks r and 2C-1-r. Under causal attention a query sees the
  keys before it, so chunk r's queries have r + 1 chunks of keys and chunk 2C-1-r's 2C - r:
  every shard has the same work, where in the contiguous layout shard r has 2r + 1 times
  shard 0's.
Global [B, T, ...] arrays hold their rows in layout order (shard 0's slots, shard 1's, ...):
token-wise layers do not care, and `to_layout` / `from_layout` move natural-order arrays in and
out. Attention knows each row's natural index (`token_index`) and brings the rows it needs:
the rows just before a chunk (`previous_rows`, a collective permute per chunk of distance) or
the whole sequence (`gather`, an all-gather). Those methods run inside a `shard_map` over
`context`; `to_layout` / `from_layout` are one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from model.parallel.mesh import logical_spec, mesh_axis_size

AXIS = "context"


@dataclasses.dataclass(frozen=True)
class ContextLayout:
    shards: int  # C, the size of the `context` axis
    slots: int  # k chunks per shard: 1 contiguous, 2 balanced

    @property
    def chunks(self) -> int:
        return self.shards * self.slots

    def chunk_of(self, shard, slot: int):
        """Natural index of the chunk in `slot` of `shard` (an int or a traced scalar)."""
        return shard if slot == 0 else self.chunks - 1 - shard

    def halo(self, reach: int, length: int) -> int:
        """Rows a chunk of a T = `length` sequence needs from before it when its first token
        looks `reach` rows back (a window's W - 1, a compressor's blocks): at most the rows of
        the chunks before it."""
        return max(0, min(reach, length - length // self.chunks))

    # ---- inside shard_map over `context` ------------------------------------------------------

    def slot_starts(self, local_length: int) -> jax.Array:
        """Natural index of each slot's first row: [k] int32."""
        chunk = local_length // self.slots
        shard = jax.lax.axis_index(AXIS)
        starts = jnp.stack([self.chunk_of(shard, j) * chunk for j in range(self.slots)])
        return starts.astype(jnp.int32)

    def token_index(self, local_length: int) -> jax.Array:
        """Natural index of each local row: [L] int32 (L = k·c rows, slot-major)."""
        chunk = local_length // self.slots
        starts = self.slot_starts(local_length)
        return (starts[:, None] + jnp.arange(chunk)[None, :]).reshape(-1).astype(jnp.int32)

    def slot_rows(self, x: jax.Array) -> jax.Array:
        """x [B, L, ...] local rows -> [B·k, c, ...]: each chunk slot its own row."""
        return x.reshape(x.shape[0] * self.slots, -1, *x.shape[2:])

    def with_previous_rows(self, x: jax.Array, count: int, fill=0) -> jax.Array:
        """x [B, L, ...] local rows -> [B·k, count + c, ...]: each chunk slot after the `count`
        rows before it (`previous_rows`)."""
        front = self.previous_rows(x, count, fill)
        return jnp.concatenate([front.reshape(-1, *front.shape[2:]), self.slot_rows(x)], axis=1)

    def previous_chunk(self, x: jax.Array) -> jax.Array:
        """x [B, k, n, ...] (per slot n rows of a chunk) -> the same rows of the chunk before
        each slot's chunk in natural order, zeros before chunk 0: one collective permute per
        slot."""
        shards = self.shards
        forward = [(r, r + 1) for r in range(shards - 1)]
        first = jax.lax.ppermute(x[:, 0], AXIS, forward)  # chunk r-1 -> slot 0 of shard r
        if self.slots == 1:
            return first[:, None]
        # slot 1 holds chunk 2C-1-r, whose predecessor is slot 1 of shard r+1 (shard C-1: its
        # own slot 0, chunk C-1)
        later = jax.lax.ppermute(x[:, 1], AXIS, [(r + 1, r) for r in range(shards - 1)])
        last = jax.lax.axis_index(AXIS) == shards - 1
        return jnp.stack([first, jnp.where(last, x[:, 0], later)], axis=1)

    def previous_rows(self, x: jax.Array, count: int, fill=0) -> jax.Array:
        """x [B, L, ...] local rows -> [B, k, count, ...]: per slot, the `count` rows before its
        first row in natural order (`fill` before the sequence starts). ceil(count / c) hops
        of `previous_chunk`, each passing on only the rows still needed."""
        batch, length = x.shape[:2]
        chunk = length // self.slots
        slots = x.reshape(batch, self.slots, chunk, *x.shape[2:])
        parts, current, left = [slots[:, :, :0]], slots, count
        while left > 0:
            take = min(left, chunk)
            current = self.previous_chunk(current[:, :, current.shape[2] - take:])
            parts.insert(0, current)
            left -= take
        halo = jnp.concatenate(parts, axis=2)
        start = self.slot_starts(length)
        before = (start[:, None] - count + jnp.arange(count)[None, :]) < 0  # [k, count]
        before = before.reshape(1, self.slots, count, *([1] * (x.ndim - 2)))
        return jnp.where(before, jnp.asarray(fill, x.dtype), halo)

    def gather(self, x: jax.Array) -> jax.Array:
        """x [B, L, ...] local rows -> [B, T, ...] the whole sequence in natural order (an
        all-gather over `context`)."""
        gathered = jax.lax.all_gather(x, AXIS, axis=1, tiled=True)  # layout order
        if self.slots == 1:
            return gathered
        batch, chunk = x.shape[0], x.shape[1] // self.slots
        by_shard = gathered.reshape(batch, self.shards, self.slots, chunk, *x.shape[2:])
        natural = jnp.concatenate([by_shard[:, :, 0], by_shard[:, ::-1, 1]], axis=1)
        return natural.reshape(batch, -1, *x.shape[2:])

    def exclusive_prefix_max(self, value: jax.Array) -> jax.Array:
        """value [B, k]: a per-slot value -> per slot, the max over every chunk before it in
        natural order (the int32 minimum for chunk 0)."""
        every = self.gather(value[:, :, None])[:, :, 0]  # [B, chunks], natural order
        low = jnp.iinfo(jnp.int32).min
        before = jnp.concatenate([jnp.full_like(every[:, :1], low),
                                  jax.lax.cummax(every, axis=1)[:, :-1]], axis=1)
        shard = jax.lax.axis_index(AXIS)
        chunks = jnp.stack([self.chunk_of(shard, j) for j in range(self.slots)])
        return before[:, chunks]

    def document_offsets(self, segment_ids: jax.Array) -> jax.Array:
        """Each local token's offset from the start of its document (a run of equal segment
        ids in natural order), as `model.ops.kv_compression.document_offsets` gives on the
        whole sequence: segment_ids [B, L] -> [B, L] int32."""
        batch, length = segment_ids.shape
        chunk = length // self.slots
        index = self.token_index(length).reshape(self.slots, chunk)
        seg = segment_ids.reshape(batch, self.slots, chunk)
        before = self.previous_rows(segment_ids, 1)  # [B, k, 1]
        previous = jnp.concatenate([before, seg[:, :, :-1]], axis=2)
        starts = (previous != seg) | (index == 0)[None]
        local = jax.lax.cummax(jnp.where(starts, index[None], -1), axis=2)  # [B, k, c]
        carried = self.exclusive_prefix_max(local[:, :, -1])
        begin = jnp.maximum(local, carried[:, :, None])
        return (index[None] - begin).reshape(batch, length)


def splits_sequences(module=None) -> bool:
    """Whether the current mesh splits sequences over `context`; never while the flax `module`
    initializes (init traces a dummy [1, 8] batch, which no layout cuts)."""
    return mesh_axis_size(AXIS) > 1 and not (module is not None and module.is_initializing())


def context_layout(cfg: ModelConfig, shards: int | None = None) -> ContextLayout:
    """The layout of `cfg` on `shards` context shards (default: the current mesh's `context`,
    1 without one): `model.context_layout`, whose `auto` is `balanced` where there are
    full-attention (F) layers, whose causal cost the balance evens out, else `contiguous`."""
    shards = mesh_axis_size(AXIS) if shards is None else shards
    setting = cfg.context_layout
    balanced = setting == "balanced" or (setting == "auto" and "F" in cfg.layout)
    return ContextLayout(shards, 2 if balanced and shards > 1 else 1)


def token_spec(ndim: int, time_axis: int = 1) -> P:
    """PartitionSpec of a [..., B, T, ...] array with rows over the batch axes and T over
    `context` (the batch dimension just before T)."""
    entries = [None] * ndim
    entries[time_axis - 1] = logical_spec("batch")[0]
    entries[time_axis] = AXIS
    return P(*entries)


def _moved(x, layout: ContextLayout, inverse: bool, time_axis: int):
    """Natural <-> balanced order of the chunks along `time_axis`, in a shard_map: each shard
    sends whole chunks with two collective permutes (before: natural chunk j sits in half
    j mod 2 of shard j // 2)."""
    spec = token_spec(x.ndim, time_axis)
    local = functools.partial(_local_move, layout=layout, inverse=inverse, axis=time_axis)
    return jax.shard_map(local, in_specs=spec, out_specs=spec, check_vma=False)(x)


def _local_move(x, *, layout: ContextLayout, inverse: bool, axis: int):
    shards = layout.shards
    x = jnp.moveaxis(x, axis, 0)
    halves = x.reshape(2, -1, *x.shape[1:])  # the shard's two chunk slots

    def home(chunk):  # the shard of natural chunk `chunk` in the balanced layout
        return chunk if chunk < shards else 2 * shards - 1 - chunk

    shard = jax.lax.axis_index(AXIS)
    received = []
    for parity in (0, 1):  # move the even, then the odd natural chunks
        if not inverse:  # natural chunk 2s + parity sits in slot `parity` of shard s
            pairs = [(s, home(2 * s + parity)) for s in range(shards)]
            received.append(jax.lax.ppermute(halves[parity], AXIS, pairs))
        else:
            pairs = []
            for r in range(shards):
                chunk = next(layout.chunk_of(r, j) for j in (0, 1)
                             if layout.chunk_of(r, j) % 2 == parity)
                pairs.append((r, chunk // 2))
            # each shard holds one chunk of each parity; send the one of this parity
            mine = jnp.where((shard % 2 == 0) == (parity == 0), halves[0], halves[1])
            received.append(jax.lax.ppermute(mine, AXIS, pairs))
    if inverse:
        out = jnp.concatenate(received, axis=0)
    else:  # an even shard receives its slot 0 from the even chunks, an odd one its slot 1
        even = shard % 2 == 0
        out = jnp.concatenate([jnp.where(even, received[0], received[1]),
                               jnp.where(even, received[1], received[0])], axis=0)
    return jnp.moveaxis(out.reshape(x.shape), 0, axis)


def to_layout(x: jax.Array, layout: ContextLayout, time_axis: int = 1) -> jax.Array:
    """A natural-order [..., B, T, ...] array -> its rows in layout order (identity for the
    contiguous layout or without `context`)."""
    if layout.slots == 1 or layout.shards == 1:
        return x
    return _moved(x, layout, inverse=False, time_axis=time_axis)


def from_layout(x: jax.Array, layout: ContextLayout, time_axis: int = 1) -> jax.Array:
    """Inverse of `to_layout`."""
    if layout.slots == 1 or layout.shards == 1:
        return x
    return _moved(x, layout, inverse=True, time_axis=time_axis)
