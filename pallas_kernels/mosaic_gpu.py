"""Where Pallas' Mosaic GPU kernels (wgmma + TMA, NVIDIA Hopper) can run, and their CPU
interpreter; shared by the kernels that wrap JAX's Mosaic GPU ops.

- `hopper_available()`: the default backend is an NVIDIA Hopper GPU (`gpu_arch.is_hopper`: the
  sm90a wgmma instructions the kernels use) and JAX's Mosaic GPU package imports.
- `interpret()`: a context in which Mosaic GPU kernels run in JAX's GPU interpreter on CPU
  (simulated shared memory, barriers and TMA copies): slow, for tests with tiny shapes. JAX
  0.12 exports it from `jax.experimental.pallas.mosaic_gpu`; 0.10.2 has it only under
  `jax._src`. The 0.10.2 interpreter does not cover every primitive: a transposed shared-memory
  view (`transpose_rhs`) and `layout_cast` (the transposed ragged dot) raise there.
"""

from __future__ import annotations

import contextlib
import functools

from pallas_kernels import gpu_arch


@functools.lru_cache(maxsize=1)
def _mosaic_gpu_imports() -> bool:
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError:  # a jaxlib built without Mosaic GPU
        return False
    return True


def hopper_available() -> bool:
    return gpu_arch.is_hopper(gpu_arch.compute_capability()) and _mosaic_gpu_imports()


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
