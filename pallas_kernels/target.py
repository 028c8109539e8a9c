"""The backend a computation is traced for: JAX's default backend, or the platform named by
`lowering_for` while a jitted function is traced and lowered for another machine.

    with lowering_for("tpu"):                      # on a CPU host
        text = jax.jit(step).trace(*abstract_args).lower(lowering_platforms=("tpu",)).as_text()

Kernel choices made while tracing (Mosaic or Triton, interpret mode or compiled, splash or
flash attention, the expert-parallel collective) read `target_backend()` instead of
`jax.default_backend()`, so a CPU host traces the program a TPU or GPU would run and
`benchmarks/lowering.py` lowers it without the hardware. JAX's jit cache does not key on this
setting: trace under `lowering_for` in a process (or with fresh jitted functions) that does not
also run the same functions for its own backend.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax

# `jax.default_backend()` names (what the code compares against) of each lowering platform.
BACKENDS = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}

# (backend, NVIDIA compute capability or None) while lowering for another platform
_TARGET: contextvars.ContextVar[tuple[str, tuple[int, int] | None] | None] = \
    contextvars.ContextVar("target_backend", default=None)


def target_backend() -> str:
    """"cpu", "gpu" or "tpu": the backend being traced for."""
    target = _TARGET.get()
    return target[0] if target else jax.default_backend()


def target_capability() -> tuple[int, int] | None:
    """The compute capability named by `lowering_for`, or None (then: the device's own)."""
    target = _TARGET.get()
    return target[1] if target else None


@contextlib.contextmanager
def lowering_for(platform: str, capability: tuple[int, int] | None = None) -> Iterator[str]:
    """Trace as if on `platform` (a `lowering_platforms` name: cpu, cuda, rocm, tpu); for cuda,
    as if on a GPU of `capability` (e.g. (9, 0), an H100: the kernel families follow it)."""
    if platform not in BACKENDS:
        raise ValueError(f"platform: expected one of {', '.join(BACKENDS)}, got {platform!r}")
    token = _TARGET.set((BACKENDS[platform], capability))
    try:
        yield BACKENDS[platform]
    finally:
        _TARGET.reset(token)
