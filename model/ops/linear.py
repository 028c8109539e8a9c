"""The dense projection `x @ W` with a backward pass laid out for the matmul (report-neutral:
the same math as `jnp.tensordot`, only the gradient's operand layouts differ).

XLA:CPU runs a matmul fast when its left operand is contracted over its innermost axis. The
default transpose rule of `dot_general` forms the weight gradient dW = xᵀ·g by contracting x
and g over their outer (token) axis, and XLA then fuses the transposes it needs into the
elementwise loops that produce g (SiLU, norm and softmax backward), which run several times
slower than a plain transpose. Here the backward transposes x on its own, a cheap copy of an
activation, and multiplies xᵀ [K, N] by g [N, M] in the layout the matmul wants; dx = g·Wᵀ
contracts both operands over their innermost axis. On GPU/TPU the matmul units take either
layout, so the transpose is left to XLA there (docs/architecture.md, "Measured on CPU").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.target import target_backend


def linear(x: jax.Array, kernel: jax.Array, contract: int = 1) -> jax.Array:
    """x [..., *in] @ kernel [*in, *out] -> [..., *out], contracting the `contract` trailing
    axes of x with the leading axes of kernel (`jnp.tensordot(x, kernel, contract)`). The
    leading axes stay apart (merging [B, T] would reshard a sequence split over `context`)."""
    inner = x.shape[x.ndim - contract:]
    if inner != kernel.shape[:contract]:
        raise ValueError(f"linear: x axes {inner} do not match kernel {kernel.shape}")
    outer, features = x.shape[:x.ndim - contract], kernel.shape[contract:]
    rows = x.reshape(*outer, math.prod(inner))
    y = _matmul(rows, kernel.reshape(math.prod(inner), math.prod(features)))
    return y.reshape(*outer, *features)


@jax.custom_vjp
def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, M] -> [..., M]."""
    return x @ w


def _matmul_fwd(x, w):
    return x @ w, (x, w)


def _matmul_bwd(residuals, g):
    x, w = residuals
    dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())))  # g [..., M] · w over M
    lead = tuple(range(x.ndim - 1))
    if target_backend() == "cpu":
        # [K, ...] @ [..., M]: a standard product after a cheap copy
        dw = jax.lax.dot_general(jnp.moveaxis(x, -1, 0), g,
                                 ((tuple(d + 1 for d in lead), lead), ((), ())))
    else:
        dw = jax.lax.dot_general(x, g, ((lead, lead), ((), ())))
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
