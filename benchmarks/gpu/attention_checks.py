"""What actually ran behind an attention implementation in a `make gpu-check` correctness check
(benchmarks.gpu.checks), read from the compiled HLO, and whether it is what should have run:

- `cudnn` on a GPU: where `model.ops.cudnn_attention.cudnn_fallback_reason` finds nothing
  cuDNN cannot express, the HLO must hold cuDNN's fused-attention custom call, and for SWA
  its sliding window (`sliding_window_length` = W in the call's config); elsewhere the note
  names the reason the layer ran the `xla` core;
- `pallas` on a GPU: the kernel family `pallas_kernels.attention.kernel_family` picks; the
  Mosaic GPU family must show its `mosaic_gpu` custom calls;
- off GPUs: the XLA fallback (cudnn) or interpret mode (pallas), with the reason.
"""

from __future__ import annotations

import re

CUDNN_CALL = "__cudnn$fmha"  # XLA's cuDNN fused multi-head attention custom calls
MOSAIC_CALL = "mosaic_gpu"


def sliding_windows(hlo: str) -> set[int]:
    """The `sliding_window_length` values of the cuDNN attention calls in `hlo`."""
    return {int(w) for w in re.findall(r'sliding_window_length"?\s*[:=]\s*"?(\d+)', hlo)}


def cudnn_verdict(backend: str, q, segment_ids, window: int | None, hlo: str,
                  capability=None) -> tuple[str, str | None]:
    """(note, problem or None) of a `cudnn` check."""
    from model.ops.cudnn_attention import cudnn_fallback_reason

    reason = cudnn_fallback_reason(q, segment_ids, backend=backend, capability=capability)
    if backend != "gpu":
        return f"XLA fallback of jax.nn.dot_product_attention ({reason})", None
    if reason is not None:
        return f"xla core: {reason}", None
    if CUDNN_CALL not in hlo:
        return "cuDNN expected", "the compiled HLO holds no cuDNN attention call"
    if window is not None and window not in sliding_windows(hlo):
        return "cuDNN fused attention", (f"no cuDNN sliding window of {window} in the HLO "
                                         f"(found {sorted(sliding_windows(hlo)) or 'none'})")
    return "cuDNN fused attention" + (f", sliding window {window}" if window else ""), None


def pallas_verdict(backend: str, q, k, v, hlo: str, capability=None) -> tuple[str, str | None]:
    """(note, problem or None) of a `pallas` attention check."""
    if backend != "gpu":
        return "Pallas interpret mode", None
    from pallas_kernels.attention import kernel_family

    if kernel_family(q, k, v, capability) == "mosaic":
        if MOSAIC_CALL not in hlo:
            return "Mosaic GPU kernels expected", "no mosaic_gpu call in the compiled HLO"
        return "Mosaic GPU kernels (sm90)", None
    return "Pallas Triton kernels", None


def attention_verdict(impl: str, backend: str, inputs: dict, window: int | None,
                      hlo: str) -> tuple[str, str | None]:
    """(note, problem or None) for any attention implementation."""
    from pallas_kernels.gpu_arch import compute_capability

    capability = compute_capability()
    if impl == "cudnn":
        return cudnn_verdict(backend, inputs["q"], inputs["segment_ids"], window, hlo,
                             capability)
    if impl == "pallas":
        return pallas_verdict(backend, inputs["q"], inputs["k"], inputs["v"], hlo, capability)
    return "", None
