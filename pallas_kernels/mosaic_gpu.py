"""Where Pallas' Mosaic GPU kernels (wgmma + TMA, NVIDIA Hopper) can run, and their CPU
interpreter; shared by the kernels that wrap JAX's Mosaic GPU ops.

- `hopper_available()`: the default backend is an NVIDIA GPU of compute capability 9.0 (the
  sm90a wgmma instructions the Hopper kernels use; Blackwell has other kernels) and JAX's
  Mosaic GPU package imports.
- `interpret()`: a context in which Mosaic GPU kernels run in JAX's GPU interpreter on CPU
  (simulated shared memory, barriers and TMA copies): slow, for tests with tiny shapes. JAX
  0.12 exports it from `jax.experimental.pallas.mosaic_gpu`; 0.10.2 has it only under
  `jax._src`. The 0.10.2 interpreter does not cover every primitive: a transposed shared-memory
  view (`transpose_rhs`) and `layout_cast` (the transposed ragged dot) raise there.
"""

from __future__ import annotations

import contextlib
import functools

import jax

HOPPER = "9.0"


@functools.lru_cache(maxsize=1)
def _mosaic_gpu_imports() -> bool:
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError:  # a jaxlib built without Mosaic GPU
        return False
    return True


def compute_capability() -> str | None:
    """"9.0" on an H100/H200; None when the default backend is not a CUDA GPU."""
    if jax.default_backend() != "gpu":
        return None
    return getattr(jax.devices()[0], "compute_capability", None)


def hopper_available() -> bool:
    return compute_capability() == HOPPER and _mosaic_gpu_imports()


def interpret() -> contextlib.AbstractContextManager:
    """Mosaic GPU kernels traced inside run in the GPU interpreter (CPU)."""
    try:
        from jax.experimental.pallas.mosaic_gpu import (
            InterpretGPUParams,
            force_gpu_interpret_mode,
        )
    except ImportError:  # jax < 0.12
        from jax._src.pallas.mosaic_gpu.interpret.params import (
            InterpretGPUParams,
            force_gpu_interpret_mode,
        )
    return force_gpu_interpret_mode(InterpretGPUParams())
