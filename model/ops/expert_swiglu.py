"""The routed experts' SwiGLU on grouped-matmul kernels (`moe_impl=pallas`), with a hand-written
VJP whose three legs each run on the kernel family chosen for them.

Rows come sorted by expert (`group_sizes[e]` rows of expert e, in order; rows past the sum belong
to no expert). Gate and up are one matmul against their weights concatenated to [E, D, 2F]:

    forward      pre = gmm(rows, gate_up)            [M, 2F]   (fwd leg of gate_up)
                 h   = SwiGLU(pre) with the clamp    [M, F]    (report 4.1.3)
                 out = gmm(h, down)                  [M, D]    (fwd leg of down)
    backward     d_down    = tgmm(h, d_out)                    (dw leg of down)
                 d_h       = gmm(d_out, down^T)                (dx leg of down)
                 d_pre     = SwiGLU'(pre) d_h
                 d_rows    = gmm(d_pre, gate_up^T)             (dx leg of gate_up)
                 d_gate_up = tgmm(rows, d_pre)                 (dw leg of gate_up)

`ExpertPlan` holds a `pallas_kernels.grouped_legs.LegPlan` per matmul (the two matmuls of a
leg differ in shape, so the measured table may pick differently). Saved for the backward pass:
the rows, `pre` and the weights; h is recomputed from `pre` (elementwise). `pre` is named
`EXPERT_GATE_UP` (`checkpoint_name`) so a names-based remat policy can keep it instead of
rerunning the forward kernels (model/layers/stack.py).

Rows past sum(group_sizes) give out = 0 and h_sq = 0 and get no gradient: every leg's kernel
returns 0 there, so pre = 0, h = SwiGLU(0) = 0; their cotangent is zeroed on entry.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from model.ops.swiglu import SwiGLUClamp, swiglu_activation
from pallas_kernels.grouped_legs import LegPlan, grouped, transposed
from pallas_kernels.saved_names import EXPERT_GATE_UP


class ExpertPlan(NamedTuple):
    gate_up: LegPlan  # rows [M, D] x [E, D, 2F]
    down: LegPlan  # h [M, F] x [E, F, D]


def _activation(pre: jax.Array, clamp: SwiGLUClamp) -> jax.Array:
    hidden = pre.shape[-1] // 2
    return swiglu_activation(pre[:, :hidden], pre[:, hidden:], clamp)


def _squared_norms(h: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(h.astype(jnp.float32)), axis=-1)


def _forward(rows, gate_up, down, group_sizes, clamp, plan, interpret):
    pre = grouped(plan.gate_up.fwd, rows, gate_up, group_sizes, interpret=interpret,
                  out_dtype=rows.dtype)
    h = _activation(pre, clamp)
    out = grouped(plan.down.fwd, h, down, group_sizes, interpret=interpret, out_dtype=rows.dtype)
    return out, _squared_norms(h), pre


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def expert_swiglu(rows, gate_up, down, group_sizes, clamp: SwiGLUClamp, plan: ExpertPlan,
                  interpret: bool):
    """rows [M, D] sorted by expert, gate_up [E, D, 2F] (gate columns first), down [E, F, D],
    group_sizes [E] int32 -> (out [M, D] in rows.dtype, h_sq [M] float32: squared norm of each
    row's SwiGLU intermediate, which gets no gradient). clamp, plan, interpret: static."""
    return _forward(rows, gate_up, down, group_sizes, clamp, plan, interpret)[:2]


def _expert_swiglu_fwd(rows, gate_up, down, group_sizes, clamp, plan, interpret):
    out, h_sq, pre = _forward(rows, gate_up, down, group_sizes, clamp, plan, interpret)
    pre = checkpoint_name(pre, EXPERT_GATE_UP)
    return (out, h_sq), (rows, pre, gate_up, down, group_sizes)


def _expert_swiglu_bwd(clamp, plan, interpret, residuals, cotangents):
    rows, pre, gate_up, down, group_sizes = residuals
    d_out, _ = cotangents  # h_sq feeds only statistics
    routed = jnp.arange(rows.shape[0])[:, None] < jnp.sum(group_sizes)
    d_out = jnp.where(routed, d_out, jnp.zeros((), d_out.dtype)).astype(rows.dtype)
    h, activation_vjp = jax.vjp(lambda p: _activation(p, clamp), pre)
    legs = dict(interpret=interpret)
    d_down = transposed(plan.down.dw, h, d_out, group_sizes, out_dtype=down.dtype, **legs)
    d_h = grouped(plan.down.dx, d_out, down, group_sizes, transpose_rhs=True,
                  out_dtype=pre.dtype, **legs)
    (d_pre,) = activation_vjp(d_h)
    d_rows = grouped(plan.gate_up.dx, d_pre, gate_up, group_sizes, transpose_rhs=True,
                     out_dtype=rows.dtype, **legs)
    d_gate_up = transposed(plan.gate_up.dw, rows, d_pre, group_sizes, out_dtype=gate_up.dtype,
                           **legs)
    return d_rows, d_gate_up, d_down, None


expert_swiglu.defvjp(_expert_swiglu_fwd, _expert_swiglu_bwd)
