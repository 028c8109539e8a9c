"""`attention_impl=pallas` on TPU: JAX's splash attention (Mosaic), wrapped to the attention-core
signature (q [B, T, H, D], k/v [B, T, K, D], window, segment_ids, sink).

Splash (`jax.experimental.pallas.ops.tpu.splash_attention`) expresses every layer of the
families' F and S attention as it is: a causal mask (`CausalMask`) or a sliding window
(`LocalMask` with W - 1 keys to the left: query i sees i - W < j <= i), segment ids
(`SegmentIds`), grouped-query heads (its MHA kernel takes K < H key/value heads and maps query
head h to KV head h // (H / K), the layout of the model's heads) and a per-head sink logit
(`sinks`, an extra exp(sink) in each softmax denominator, with its gradient), values of another
head dim than the keys included. No kernel of ours is needed on TPU.

What this wrapper adds: the 1/sqrt(D) scale (splash takes the scores unscaled), the
[B, H, T, D] layout splash wants (vmapped over the batch), and padding T up to a multiple of 128
(splash's blocks are multiples of the 128 lanes). Padded keys come after every real query, so
causality hides them; padded query rows are dropped.

Blocks: the largest of 512 / 256 / 128 dividing the padded length, for the forward and both
backward kernels (untuned; a TPU sweep belongs in benchmarks). Verified here: interpret-mode
results and gradients on CPU against the XLA path (tests/pallas_kernels/test_splash_attention.py)
and lowering to Mosaic for TPU from a CPU host (`python -m benchmarks.lowering`). Not verified:
compilation by libtpu and any run on a TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from pallas_kernels.target import target_backend

LANES = 128  # splash's blocks are multiples of the TPU's 128 lanes
BLOCKS = (512, 256, 128)  # preferred block sizes, largest first


def block_size(padded_len: int) -> int:
    return next(b for b in BLOCKS if padded_len % b == 0)


def make_kernel(num_heads: int, padded_len: int, window: int | None, interpret: bool):
    """The splash MHA kernel for `num_heads` query heads over `padded_len` positions."""
    shape = (padded_len, padded_len)
    head_mask = masks.CausalMask(shape) if window is None else masks.LocalMask(
        shape, (window - 1, 0), 0)
    b = block_size(padded_len)
    blocks = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                               block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b,
                               block_kv_dq=b)
    return splash.make_splash_mha(masks.MultiHeadMask([head_mask] * num_heads),
                                  block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def splash_attention(q, k, v, *, window=None, segment_ids=None, sink=None, interpret=None):
    """q [B, T, H, D]; k [B, T, K, D]; v [B, T, K, Dv]; segment_ids [B, T] or None; sink [H]
    or None -> [B, T, H, Dv] in q.dtype. interpret=None: interpret mode when tracing for CPU."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window: expected None or a positive int, got {window!r}")
    interpret = target_backend() == "cpu" if interpret is None else bool(interpret)
    batch, length, heads, head_dim = q.shape
    padded = -(-length // LANES) * LANES

    def heads_major(x):  # [B, T, N, D] -> [B, N, padded, D]
        x = jnp.pad(x, ((0, 0), (0, padded - length), (0, 0), (0, 0)))
        return jnp.swapaxes(x, 1, 2)

    scale = np.float32(head_dim ** -0.5)
    q_scaled = (q.astype(jnp.float32) * scale).astype(q.dtype)
    kernel = make_kernel(heads, padded, window, interpret)
    if segment_ids is None:
        out = jax.vmap(lambda q, k, v: kernel(q, k, v, None, sink))(
            heads_major(q_scaled), heads_major(k), heads_major(v))
    else:
        ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, padded - length)), mode="edge")
        out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(s, s), sink))(
            heads_major(q_scaled), heads_major(k), heads_major(v), ids)
    return jnp.swapaxes(out, 1, 2)[:, :length].astype(q.dtype)


def splash_attention_core(q, k, v, *, window, segment_ids, sink):
    """The attention-core signature of `attention_impl` (what "pallas" runs on TPU)."""
    return splash_attention(q, k, v, window=window, segment_ids=segment_ids, sink=sink)
