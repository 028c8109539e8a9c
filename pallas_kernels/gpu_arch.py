"""Which NVIDIA GPU JAX runs on: kernel families are chosen by compute capability (Mosaic GPU
kernels use Hopper's wgmma and TMA, so they need sm90; Triton kernels run on any CUDA GPU).

Callers pass the capability on, so the rules can be asked about a device other than the one
present (e.g. an H100's on a CPU-only machine).
"""

from __future__ import annotations

import jax

from pallas_kernels.target import target_backend, target_capability

HOPPER = (9, 0)  # wgmma + TMA (sm90); Blackwell (sm100) has tcgen05 instead of wgmma


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of device 0 when it is an NVIDIA GPU (or of the GPU `pallas_kernels.target`
    lowers for), else None."""
    if target_backend() != "gpu":
        return None
    if target_capability() is not None:  # lowering for a GPU this host does not have
        return target_capability()
    text = getattr(jax.devices()[0], "compute_capability", None)
    if not text:  # a ROCm device has none
        return None
    major, _, minor = str(text).partition(".")
    return int(major), int(minor or 0)


def is_hopper(capability: tuple[int, int] | None) -> bool:
    """True for sm90 (H100, H200, H20): where the Mosaic GPU (wgmma) kernels run."""
    return capability == HOPPER
