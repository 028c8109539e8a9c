"""Attention cores behind `attention_impl`: same semantics, different kernels
(docs/architecture.md, "Implementation tables").

All cores take q: [B, T, H, D], k: [B, T, K, D], v: [B, T, K, Dv] with H = K * G (GQA: the G
query heads of a group share one KV head, never materialised as repeats) and return
[B, T, H, Dv] in q.dtype. Dv may differ from D (MiMo-V2-Flash: D = 192, Dv = 128); kernels
that need one head dim get zero-padded values (`with_values_padded`).

Masking (docs/architecture.md, "Exact semantics"): query i sees key j iff j <= i,
i - j < window (window=None: full causal) and segment_ids[i] == segment_ids[j] (packed
documents never attend across each other).
An optional per-head sink logit adds exp(sink) to each softmax denominator (report 2.3, the
input-independent alternative to the head-wise gate).

- `xla`: full layers build [T, T] scores (skipping most of the causally masked half); SWA
  layers run chunked local attention in O(T·W). Both reduce to `masked_attention`, whose kernel
  `model.ops.attention_vjp.grouped_attention` has a hand-written VJP laid out for XLA:CPU.
- `cudnn`: `jax.nn.dot_product_attention` (`model.ops.cudnn_attention`: cuDNN on NVIDIA GPUs
  for what its kernel expresses, the `xla` core otherwise).
- `pallas`: flash-attention kernels (`pallas_kernels.attention`: Mosaic GPU on Hopper, Triton
  on other GPUs, interpret mode on CPU), imported on first use.

`model.ops.tables.ATTENTION` names the function of each `attention_impl`.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from model.ops.attention_vjp import grouped_attention

MIN_CHUNK = 128  # smallest query chunk of the local path (small windows still get wide matmuls)
CAUSAL_BLOCKS = 4  # query blocks of the dense path (at least MIN_CHUNK rows each)


class AttentionCore(Protocol):
    def __call__(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        *,
        window: int | None,
        segment_ids: jax.Array | None,
        sink: jax.Array | None,
    ) -> jax.Array: ...


def _visible(q_idx, k_idx, window: int | None):
    """Causal (+window) visibility of key index k_idx from query index q_idx (broadcasting)."""
    visible = k_idx <= q_idx
    if window is not None:
        visible &= q_idx - k_idx < window
    return visible


def masked_attention(q, k, v, mask, sink):
    """Attention with an explicit visibility mask. q: [..., T, H, D]; k: [..., S, K, D];
    v: [..., S, K, Dv]; mask: bool [..., T, S], leading axes of size 1 broadcast (query t sees
    key s); sink: [H] or None -> [..., T, H, Dv] in q.dtype.

    Lays the heads out as `grouped_attention` blocks: one block per leading index and KV head,
    holding that KV head's G query heads as G·T rows. Only [T, D]-sized arrays are transposed.
    """
    *lead, length, num_heads, head_dim = q.shape
    num_kv = k.shape[-2]
    groups = num_heads // num_kv
    # [..., T, K, G, D] -> [..., K, G, T, D]
    q_rows = jnp.moveaxis(q.reshape(*lead, length, num_kv, groups, head_dim), -4, -2)
    k_rows, v_rows = (jnp.moveaxis(x, -2, -3) for x in (k, v))  # [..., K, S, D]
    mask = jnp.broadcast_to(mask[..., None, :, :], (*lead, num_kv, *mask.shape[-2:]))
    if sink is not None:
        sink = sink.astype(jnp.float32).reshape(num_kv, groups)
        sink = jnp.broadcast_to(sink, (*lead, num_kv, groups)).reshape(-1, groups)

    def blocks(x, rows):
        """[..., K, (G,) rows, last] -> [L, rows, last] (L = blocks)."""
        return x.reshape(-1, rows, x.shape[-1])

    out = grouped_attention(blocks(q_rows, groups * length), blocks(k_rows, k.shape[-3]),
                            blocks(v_rows, v.shape[-3]), blocks(mask, length), sink)
    v_head_dim = v.shape[-1]
    out = out.reshape(*lead, num_kv, groups, length, v_head_dim)
    return jnp.moveaxis(out, -2, -4).reshape(*lead, length, num_heads, v_head_dim)


def dense_attention(q, k, v, *, window, segment_ids, sink):
    """The full-layer path (and SWA when W >= T): O(T²) scores, less most of the causally
    masked half: queries are split into up to `CAUSAL_BLOCKS` blocks, and a block attends only
    to the keys up to its last query (4 blocks: 5/8 of the [T, T] scores are computed).
    """
    length = q.shape[1]
    idx = jnp.arange(length)
    mask = _visible(idx[:, None], idx[None, :], window)[None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    block = max(-(-length // CAUSAL_BLOCKS), MIN_CHUNK)
    outs = []
    for start in range(0, length, block):
        end = min(start + block, length)
        outs.append(masked_attention(q[:, start:end], k[:, :end], v[:, :end],
                                     mask[:, start:end, :end], sink))
    return jnp.concatenate(outs, axis=1)


def local_attention(q, k, v, *, window, segment_ids, sink):
    """Sliding-window attention in O(T·W) time and memory, never a [T, T] score matrix.

    Queries are split into chunks of C >= W rows; chunk c attends to keys of chunks c-1 and c
    (2C keys), which cover every key in (i - W, i] for all its queries.
    """
    batch, length, num_heads, head_dim = q.shape
    chunk = max(window, MIN_CHUNK)
    if chunk >= length:
        return dense_attention(q, k, v, window=window, segment_ids=segment_ids, sink=sink)
    num_chunks = -(-length // chunk)
    pad = num_chunks * chunk - length

    def chunked(x, front):
        """Pads axis 1 with `front` leading and `pad` trailing zeros, splits it into chunks."""
        widths = [(0, 0)] * x.ndim
        widths[1] = (front, pad)
        x = jnp.pad(x, widths)
        return x.reshape(batch, -1, chunk, *x.shape[2:])

    def with_previous_chunk(x):
        """[B, T, ...] -> [B, n, 2C, ...]: chunk c-1 followed by chunk c (zeros before chunk 0)."""
        xc = chunked(x, chunk)
        return jnp.concatenate([xc[:, :-1], xc[:, 1:]], axis=2)

    q_idx = jnp.arange(chunk)[:, None] + chunk  # query index relative to the chunk pair start
    k_idx = jnp.arange(2 * chunk)[None, :]
    key_position = (jnp.arange(num_chunks)[:, None] - 1) * chunk + k_idx  # [n, 2C] absolute
    key_exists = (key_position >= 0) & (key_position < length)  # excludes all padding keys
    mask = (_visible(q_idx, k_idx, window)[None] & key_exists[:, None, :])[None]  # [1, n, C, 2C]
    if segment_ids is not None:
        q_seg = chunked(segment_ids, 0)
        k_seg = with_previous_chunk(segment_ids)
        mask = mask & (q_seg[..., :, None] == k_seg[..., None, :])
    out = masked_attention(chunked(q, 0), with_previous_chunk(k), with_previous_chunk(v), mask,
                           sink)
    return out.reshape(batch, num_chunks * chunk, num_heads, v.shape[-1])[:, :length]


def xla_attention(q, k, v, *, window, segment_ids, sink):
    if window is None:
        return dense_attention(q, k, v, window=None, segment_ids=segment_ids, sink=sink)
    return local_attention(q, k, v, window=window, segment_ids=segment_ids, sink=sink)


def with_values_padded(core: AttentionCore) -> AttentionCore:
    """`core` for values narrower than the queries and keys, for kernels that need one head dim
    (`jax.nn.dot_product_attention`, the Pallas kernel): values are zero-padded to D and the
    output's padding columns, exactly zero, are dropped. v: [B, T, K, Dv] -> [B, T, H, Dv]."""

    def padded(q, k, v, **kwargs):
        v_head_dim = v.shape[-1]
        widths = [(0, 0)] * (v.ndim - 1) + [(0, q.shape[-1] - v_head_dim)]
        return core(q, k, jnp.pad(v, widths), **kwargs)[..., :v_head_dim]

    return padded
