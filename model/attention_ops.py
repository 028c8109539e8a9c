"""Attention cores behind `attention_impl` (DESIGN.md §2): same semantics, different kernels.

All cores take q: [B, T, H, D], k/v: [B, T, K, D] with H = K * G (GQA: the G query heads of a
group share one KV head, never materialised as repeats) and return [B, T, H, D] in q.dtype.

Masking (DESIGN.md §3): query i sees key j iff j <= i, i - j < window (window=None: full causal)
and segment_ids[i] == segment_ids[j] (packed documents never attend across each other).
An optional per-head sink logit adds exp(sink) to each softmax denominator (report 2.3, the
input-independent alternative to the head-wise gate).

- `xla`: full layers build [T, T] scores; SWA layers run chunked local attention in O(T·W).
- `cudnn`: `jax.nn.dot_product_attention` (cuDNN on NVIDIA GPUs, XLA elsewhere).
- `pallas`: registered by `pallas_kernels` when that package provides its kernels.
"""

from __future__ import annotations

import importlib
from typing import Callable, Protocol

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite "minus infinity": keeps gradients NaN-free on fully masked entries
MIN_CHUNK = 128  # smallest query chunk of the local path (small windows still get wide matmuls)


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


def _masked_softmax(scores: jax.Array, mask: jax.Array, sink: jax.Array | None) -> jax.Array:
    """Softmax over the last axis in float32; `sink` broadcasts against scores[..., 0]."""
    scores = jnp.where(mask, scores, _NEG)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    if sink is not None:
        row_max = jnp.maximum(row_max, sink[..., None])
    row_max = jax.lax.stop_gradient(row_max)
    weights = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denominator = jnp.sum(weights, axis=-1, keepdims=True)
    if sink is not None:
        denominator = denominator + jnp.exp(sink[..., None] - row_max)
    return weights / jnp.maximum(denominator, jnp.finfo(jnp.float32).tiny)


def _visible(q_idx, k_idx, window: int | None):
    """Causal (+window) visibility of key index k_idx from query index q_idx (broadcasting)."""
    visible = k_idx <= q_idx
    if window is not None:
        visible &= q_idx - k_idx < window
    return visible


def _sink_for_groups(sink: jax.Array | None, num_kv: int):
    """[H] -> [K, G, 1] so it broadcasts against scores [..., K, G, Tq, Tk][..., 0]."""
    if sink is None:
        return None
    return sink.astype(jnp.float32).reshape(num_kv, -1, 1)


def dense_attention(q, k, v, *, window, segment_ids, sink):
    """Materialises [T, T] scores per head: the full-layer path (and SWA when W >= T)."""
    batch, length, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    qg = q.reshape(batch, length, num_kv, num_heads // num_kv, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * head_dim**-0.5
    idx = jnp.arange(length)
    mask = _visible(idx[:, None], idx[None, :], window)[None, None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
    probs = _masked_softmax(scores, mask, _sink_for_groups(sink, num_kv))
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(batch, length, num_heads, head_dim).astype(q.dtype)


def local_attention(q, k, v, *, window, segment_ids, sink):
    """Sliding-window attention in O(T·W) time and memory, never a [T, T] score matrix.

    Queries are split into chunks of C >= W rows; chunk c attends to keys of chunks c-1 and c
    (2C keys), which cover every key in (i - W, i] for all its queries.
    """
    batch, length, num_heads, head_dim = q.shape
    chunk = max(window, MIN_CHUNK)
    if chunk >= length:
        return dense_attention(q, k, v, window=window, segment_ids=segment_ids, sink=sink)
    num_kv, groups = k.shape[2], num_heads // k.shape[2]
    num_chunks = -(-length // chunk)
    pad = num_chunks * chunk - length
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, length), jnp.int32)

    def pad_time(x, front, front_value=0, back_value=0):
        """Pads axis 1 with `front` leading and `pad` trailing entries."""
        widths = [(0, 0)] * x.ndim
        widths[1] = (front, 0)
        x = jnp.pad(x, widths, constant_values=front_value)
        widths[1] = (0, pad)
        return jnp.pad(x, widths, constant_values=back_value)

    qc = pad_time(q, 0).reshape(batch, num_chunks, chunk, num_kv, groups, head_dim)

    def with_previous_chunk(x, front_value=0, back_value=0):
        """[B, T, ...] -> [B, n, 2C, ...]: chunk c-1 followed by chunk c (padding before chunk 0)."""
        xc = pad_time(x, chunk, front_value, back_value).reshape(batch, num_chunks + 1, chunk, *x.shape[2:])
        return jnp.concatenate([xc[:, :-1], xc[:, 1:]], axis=2)

    kc, vc = with_previous_chunk(k), with_previous_chunk(v)
    # Trailing padding gets segment -1 on both sides (padded queries see padded keys, keeping
    # every softmax row non-empty); the leading key padding gets -2 and matches nothing.
    q_seg = pad_time(segment_ids, 0, back_value=-1).reshape(batch, num_chunks, chunk)
    k_seg = with_previous_chunk(segment_ids, front_value=-2, back_value=-1)

    scores = jnp.einsum("bnukgd,bnrkd->bnkgur", qc, kc, preferred_element_type=jnp.float32)
    scores = scores * head_dim**-0.5
    q_idx = jnp.arange(chunk)[:, None] + chunk  # query index relative to the chunk pair start
    k_idx = jnp.arange(2 * chunk)[None, :]
    mask = _visible(q_idx, k_idx, window)[None, None, None, None]
    mask = mask & (q_seg[..., :, None] == k_seg[..., None, :])[:, :, None, None]
    probs = _masked_softmax(scores, mask, _sink_for_groups(sink, num_kv))
    out = jnp.einsum("bnkgur,bnrkd->bnukgd", probs.astype(v.dtype), vc)
    out = out.reshape(batch, num_chunks * chunk, num_heads, head_dim)[:, :length]
    return out.astype(q.dtype)


def xla_attention(q, k, v, *, window, segment_ids, sink):
    if window is None:
        return dense_attention(q, k, v, window=None, segment_ids=segment_ids, sink=sink)
    return local_attention(q, k, v, window=window, segment_ids=segment_ids, sink=sink)


def cudnn_attention(q, k, v, *, window, segment_ids, sink):
    """`jax.nn.dot_product_attention`: cuDNN flash attention on NVIDIA GPUs, XLA elsewhere.

    The sink is folded in afterwards from the returned log-sum-exp:
    softmax with an extra exp(s) term = plain output * Z / (Z + e^s) = output * sigmoid(lse - s).
    Segment ids become an explicit [B, 1, T, T] mask.
    """
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    result = jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        return_residual=sink is not None,
    )
    if sink is None:
        return result
    out, lse = result  # lse: [B, T, H]
    scale = jax.nn.sigmoid(lse.astype(jnp.float32) - sink.astype(jnp.float32))
    return (out.astype(jnp.float32) * scale[..., None]).astype(q.dtype)


_CORES: dict[str, AttentionCore] = {"xla": xla_attention, "cudnn": cudnn_attention}
# Implementations that live in other packages and register themselves when imported.
_PROVIDERS = {"pallas": "pallas_kernels"}


def register_attention_impl(name: str, core: AttentionCore) -> None:
    _CORES[name] = core


def attention_core(impl: str) -> Callable[..., jax.Array]:
    if impl not in _CORES and impl in _PROVIDERS:
        importlib.import_module(_PROVIDERS[impl])
    if impl not in _CORES:
        raise ValueError(
            f"attention_impl: {impl!r} has no registered kernel (available: {sorted(_CORES)}); "
            f"the Pallas kernels are added by the `pallas_kernels` package"
        )
    return _CORES[impl]
