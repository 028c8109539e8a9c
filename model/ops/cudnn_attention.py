"""`attention_impl=cudnn`: cuDNN flash attention through `jax.nn.dot_product_attention`, for
what its fused kernel can express; the `xla` core otherwise.

On an NVIDIA GPU the core names `implementation="cudnn"` itself: `implementation=None` always
takes the XLA path (JAX 0.10-0.11, "defaults to XLA for now"), which the first H200 run showed
(docs/kernels.md). What cuDNN expresses, checked per call by `cudnn_fallback_reason`:
- 16-bit inputs (bfloat16, float16);
- no segment ids: the public API takes packed documents only as an explicit [B, 1, T, T] mask,
  which cuDNN applies as a dense bias (O(T^2) memory: out of memory at 32k on an H200);
- a head dim that is a multiple of 8 and at most 128 (256 from Hopper, sm90, on);
- SWA through cuDNN's own sliding window (`local_window_size=(W - 1, 0)` with `is_causal`:
  keys i - W < j <= i), so SWA costs O(T·W);
- the sink logit folded in from the kernel's log-sum-exp (`_attention_with_sink`): plain
  output times sigmoid(lse - sink), with a hand-written VJP.
Where a rule fails the layer runs the `xla` core (chunked O(T·W) SWA) and one line is logged
per distinct reason. Off GPUs the core is `jax.nn.dot_product_attention`'s XLA path, which the
CPU tests use to check the sink fold.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from model.ops.attention_cores import with_values_padded, xla_attention
from pallas_kernels.gpu_arch import HOPPER, compute_capability
from pallas_kernels.target import target_backend

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = {"before sm90": 128, "sm90+": 256}
_NOTED: set[str] = set()


def cudnn_fallback_reason(q, segment_ids, *, backend: str | None = None,
                          capability: tuple[int, int] | None = None) -> str | None:
    """Why cuDNN's fused kernel cannot run attention on q [B, T, H, D] (and those segment ids)
    on `backend` (default: JAX's) with that compute capability (default: device 0's), or None
    when it can (the rules of the module docstring, in order)."""
    backend = target_backend() if backend is None else backend
    if backend != "gpu":
        return f"no cuDNN on {backend}"
    if q.dtype not in CUDNN_DTYPES:
        return f"cuDNN flash attention takes bfloat16/float16, got {q.dtype}"
    if segment_ids is not None:
        return "segment ids would reach cuDNN as a dense [T, T] bias"
    capability = compute_capability() if capability is None else capability
    limit = MAX_HEAD_DIM["sm90+" if capability and capability >= HOPPER else "before sm90"]
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > limit:
        return f"head dim {head_dim}: cuDNN takes multiples of 8 up to {limit} on this GPU"
    return None


def _note_fallback(reason: str) -> None:
    if reason not in _NOTED:
        _NOTED.add(reason)
        logging.getLogger(__name__).warning("attention_impl=cudnn: %s; this layer runs the "
                                            "xla core", reason)


def _dot_product_attention(q, k, v, mask, window, implementation, return_residual=False):
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        return_residual=return_residual, implementation=implementation,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention_with_sink(q, k, v, sink, mask, window, implementation):
    return _attention_with_sink_fwd(q, k, v, sink, mask, window, implementation)[0]


def _attention_with_sink_fwd(q, k, v, sink, mask, window, implementation):
    """o = y * s with s = Z / (Z + e^sink) = sigmoid(lse - sink), lse from the fused kernel."""
    y, lse = _dot_product_attention(q, k, v, mask, window, implementation, return_residual=True)
    scale = jax.nn.sigmoid(lse.astype(jnp.float32) - sink.astype(jnp.float32))  # [B, T, H]
    out = (y.astype(jnp.float32) * scale[..., None]).astype(q.dtype)
    return out, (q, k, v, sink, mask, y, scale)


def _attention_with_sink_bwd(window, implementation, residuals, d_out):
    """The kernel returns lse without a gradient, so its path is added by hand:
    dL/dlse_i = s(1-s) <dO_i, y_i>; d lse_i/dq_i = c sum_j p_ij k_j (attention with V = K);
    d lse_i/dk_j = c p_ij q_i (the attention V-gradient with dO_i = q_i); c = 1/sqrt(d)."""
    q, k, v, sink, mask, y, scale = residuals
    attend = functools.partial(_dot_product_attention, mask=mask, window=window,
                               implementation=implementation)
    d_out = d_out.astype(jnp.float32)
    d_lse = jnp.sum(d_out * y.astype(jnp.float32), -1) * scale * (1 - scale)  # [B, T, H]
    _, attention_vjp = jax.vjp(lambda q, k, v: attend(q, k, v), q, k, v)
    dq, dk, dv = attention_vjp((d_out * scale[..., None]).astype(q.dtype))
    softmax_scale = q.shape[-1] ** -0.5
    mean_keys = attend(q, k, k).astype(jnp.float32)
    dq = dq + (softmax_scale * d_lse[..., None] * mean_keys).astype(dq.dtype)
    _, value_vjp = jax.vjp(lambda values: attend(q, k, values), v)
    (dk_from_lse,) = value_vjp((d_lse[..., None] * q.astype(jnp.float32)).astype(q.dtype))
    dk = dk + (softmax_scale * dk_from_lse.astype(jnp.float32)).astype(dk.dtype)
    d_sink = -jnp.sum(d_lse, axis=(0, 1)).astype(sink.dtype)
    return dq, dk, dv, d_sink, None


_attention_with_sink.defvjp(_attention_with_sink_fwd, _attention_with_sink_bwd)


def cudnn_attention(q, k, v, *, window, segment_ids, sink):
    """The `cudnn` attention core (module docstring): cuDNN where `cudnn_fallback_reason` is
    None, the `xla` core on a GPU where it is not, `jax.nn.dot_product_attention`'s XLA path
    off GPUs (segment ids as an explicit mask there). Values narrower than the keys (MiMo's
    Dv < D) are zero-padded to D, which the fused kernel needs, and the output cut back."""
    if v.shape[-1] != q.shape[-1]:
        return with_values_padded(cudnn_attention)(q, k, v, window=window,
                                                   segment_ids=segment_ids, sink=sink)
    reason = cudnn_fallback_reason(q, segment_ids)
    implementation = "cudnn" if reason is None else "xla"
    if reason is not None and target_backend() == "gpu":
        _note_fallback(reason)
        return xla_attention(q, k, v, window=window, segment_ids=segment_ids, sink=sink)
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    if sink is None:
        return _dot_product_attention(q, k, v, mask, window, implementation)
    return _attention_with_sink(q, k, v, sink, mask, window, implementation)
