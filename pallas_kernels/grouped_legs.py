"""The three legs of a grouped matmul layer, each on a kernel family of its own choice.

A grouped matmul y = gmm(x, w) (rows of x sorted by group, w [E, K, N]) has three legs:

    fwd   y  = gmm(x, w)                         [M, K] x [E, K, N] -> [M, N]
    dx    dx = gmm(dy, w, transpose_rhs=True)    [M, N] x [E, K, N] -> [M, K]
    dw    dw = tgmm(x, dy)                       [M, K] x [M, N]    -> [E, K, N]

and every family implements fwd/dx as one `grouped` call and dw as one `transposed` call with
the semantics of `pallas_kernels.grouped_matmul` (rows past sum(group_sizes) give 0 and add
nothing; an empty group's dw is exactly 0):

    mosaic_gpu  JAX's Mosaic GPU kernels for Hopper (`grouped_matmul_mgpu`; config: `Blocks`)
    triton      our Pallas Triton kernels for NVIDIA GPUs (`grouped_matmul_triton`; `Tiling`)
    mosaic_tpu  our Pallas Mosaic kernels for TPU (`grouped_matmul`; `Tiling`)
    xla         `lax.ragged_dot` / `lax.ragged_dot_general` (no config): what XLA makes of it
                (on GPU a dense matmul against every group unless its cuDNN fusion applies)

A `LegChoice` names the family and its config (None: the family's default); a `LegPlan` holds one
per leg. `pallas_kernels.grouped_leg_table` says which plan a device gets.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import grouped_matmul, grouped_matmul_mgpu, grouped_matmul_triton
from pallas_kernels.grouped_common import (
    Tiling,
    gmm_shapes,
    matmul_precision,
    resolve_interpret,
    tgmm_shapes,
)

LEGS = ("fwd", "dx", "dw")


class LegChoice(NamedTuple):
    backend: str
    config: tuple | None = None  # Blocks (mosaic_gpu), Tiling (triton, mosaic_tpu), None


class LegPlan(NamedTuple):
    fwd: LegChoice
    dx: LegChoice
    dw: LegChoice

    @classmethod
    def uniform(cls, backend: str, config: tuple | None = None) -> "LegPlan":
        choice = LegChoice(check_backend(backend), config)
        return cls(choice, choice, choice)


def _xla_grouped(lhs, rhs, group_sizes, *, transpose_rhs, config, interpret, out_dtype):
    del config, interpret
    _, _, _, out_dtype = gmm_shapes(lhs, rhs, transpose_rhs, out_dtype)
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    out = jax.lax.ragged_dot(lhs.astype(dtype), rhs.astype(dtype), group_sizes,
                             precision=matmul_precision(dtype),
                             preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


_TRANSPOSED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def _xla_transposed(lhs, rhs, group_sizes, *, config, interpret, out_dtype):
    del config, interpret
    *_, out_dtype = tgmm_shapes(lhs, rhs, group_sizes, out_dtype)
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    out = jax.lax.ragged_dot_general(lhs.astype(dtype), rhs.astype(dtype), group_sizes,
                                     _TRANSPOSED, precision=matmul_precision(dtype),
                                     preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _tiled(call: Callable) -> Callable:
    """A Triton / Mosaic TPU call with its `tiling` taken from the choice's config."""

    def run(*args, config, interpret, out_dtype, **kwargs):
        tiling = None if config is None else Tiling(*config)
        return call(*args, tiling=tiling, interpret=interpret, out_dtype=out_dtype, **kwargs)

    return run


def _blocked(call: Callable) -> Callable:
    """A Mosaic GPU call with its `blocks` taken from the choice's config."""

    def run(*args, config, interpret, out_dtype, **kwargs):
        return call(*args, blocks=config, interpret=resolve_interpret(interpret),
                    out_dtype=out_dtype, **kwargs)

    return run


# backend -> (grouped: fwd / dx, transposed: dw)
BACKENDS: dict[str, tuple[Callable, Callable]] = {
    "mosaic_gpu": (_blocked(grouped_matmul_mgpu.gmm), _blocked(grouped_matmul_mgpu.tgmm)),
    "triton": (_tiled(grouped_matmul_triton.gmm_call), _tiled(grouped_matmul_triton.tgmm)),
    "mosaic_tpu": (_tiled(grouped_matmul.gmm_call), _tiled(grouped_matmul.tgmm)),
    "xla": (_xla_grouped, _xla_transposed),
}


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"grouped matmul backend: expected one of {tuple(BACKENDS)}, "
                         f"got {backend!r}")
    return backend


def grouped(choice: LegChoice, lhs, rhs, group_sizes, *, transpose_rhs=False, interpret=None,
            out_dtype=None):
    """fwd / dx leg: lhs [M, K], rhs [E, K, N] ([E, N, K] with transpose_rhs) -> [M, N]."""
    call = BACKENDS[check_backend(choice.backend)][0]
    return call(lhs, rhs, group_sizes.astype(jnp.int32), transpose_rhs=transpose_rhs,
                config=choice.config, interpret=interpret, out_dtype=out_dtype)


def transposed(choice: LegChoice, lhs, rhs, group_sizes, *, interpret=None, out_dtype=None):
    """dw leg: lhs [M, K], rhs [M, N] -> [E, K, N]."""
    call = BACKENDS[check_backend(choice.backend)][1]
    return call(lhs, rhs, group_sizes.astype(jnp.int32), config=choice.config,
                interpret=interpret, out_dtype=out_dtype)
