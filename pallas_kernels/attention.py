"""`attention_impl=pallas`: which flash-attention kernel family runs (`KERNELS`).

- "mosaic" (pallas_kernels/flash_attention_mgpu.py): Mosaic GPU (wgmma + TMA) on Hopper, sm90,
  for 16-bit inputs with head dims that are multiples of 64 up to 256; values may be narrower
  than queries and keys (MiMo-V2-Flash's 192 / 128), taken as they are;
- "triton" (pallas_kernels/flash_attention.py): every other GPU and input (float32, head dims
  off the Mosaic tiles such as DeepSeek-V4's 512), with values zero-padded to the query head
  dim; on CPU it runs in Pallas interpret mode.
Both have the semantics of the `xla` core (model/ops/attention_cores.py).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import gpu_arch
from pallas_kernels.flash_attention import flash_attention


def mosaic_attention(q, k, v, *, window, segment_ids, sink):
    from pallas_kernels.flash_attention_mgpu import mgpu_flash_attention
    return mgpu_flash_attention(q, k, v, window=window, segment_ids=segment_ids, sink=sink)


def triton_attention(q, k, v, *, window, segment_ids, sink):
    v_head_dim = v.shape[-1]
    if v_head_dim != q.shape[-1]:  # one head dim: zero columns give zero outputs, sliced away
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - v_head_dim)])
    out = flash_attention(q, k, v, window=window, segment_ids=segment_ids, sink=sink)
    return out[..., :v_head_dim]


KERNELS = {"mosaic": mosaic_attention, "triton": triton_attention}
# family -> why it is not to be used in this process (set by a caller that found it failing on
# the device, e.g. `make gpu-check`'s probe); "triton" is the fallback and never listed
UNAVAILABLE: dict[str, str] = {}


def kernel_family(q, k, v, capability: tuple[int, int] | None) -> str:
    """"mosaic" or "triton" for these inputs on a device of that compute capability (None:
    not an NVIDIA GPU)."""
    if gpu_arch.is_hopper(capability) and "mosaic" not in UNAVAILABLE:
        from pallas_kernels.flash_attention_mgpu import unsupported_reason
        if unsupported_reason(q, k, v) is None:
            return "mosaic"
    return "triton"


def flash_attention_core(q, k, v, *, window, segment_ids, sink):
    """The attention-core signature of `attention_impl` (entry "pallas" of the model's table):
    q [B, T, H, D], k [B, T, K, D], v [B, T, K, Dv] -> [B, T, H, Dv]."""
    family = KERNELS[kernel_family(q, k, v, gpu_arch.compute_capability())]
    return family(q, k, v, window=window, segment_ids=segment_ids, sink=sink)
