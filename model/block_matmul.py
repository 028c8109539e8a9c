"""Grouped matmul over row blocks, each block owned by one expert (the CPU `sorted` MoE path).

x is split into `num_blocks` blocks of `block` rows; block b multiplies expert
`block_expert[b]`'s weight. Only the first `num_active` blocks hold rows: the rest are skipped
at run time with `lax.cond`, so the static worst-case block count (needed for dropless routing
with static shapes) costs almost nothing when routing is balanced. The loop reads one expert's
weight per block in place (no [num_blocks, K, N] gather), and the backward pass accumulates the
weight gradient per expert in place (`drhs`, a "transposed grouped matmul").
"""

import jax
import jax.numpy as jnp


def _per_block(num_active, fn, zeros_shape, dtype):
    """Wraps fn(block inputs...) so blocks at index >= num_active return zeros."""

    def step(index, *inputs):
        return jax.lax.cond(index < num_active, lambda: fn(*inputs).astype(dtype),
                            lambda: jnp.zeros(zeros_shape, dtype))

    return step


def _forward(x, w, block_expert, num_active):
    """x: [nb, m, K], w: [E, K, N] -> [nb, m, N]."""
    num_blocks, block, _ = x.shape
    step = _per_block(num_active, lambda xb, e: xb @ w[e], (block, w.shape[2]), x.dtype)

    def body(_, inputs):
        return None, step(*inputs)

    return jax.lax.scan(body, None, (jnp.arange(num_blocks), x, block_expert))[1]


@jax.custom_vjp
def block_grouped_matmul(x, w, block_expert, num_active):
    """x: [nb, m, K]; w: [E, K, N]; block_expert: [nb] int32; num_active: int32 scalar.

    Returns [nb, m, N] with block b = x[b] @ w[block_expert[b]] for b < num_active, else 0.
    """
    return _forward(x, w, block_expert, num_active)


def _fwd(x, w, block_expert, num_active):
    return _forward(x, w, block_expert, num_active), (x, w, block_expert, num_active)


def _bwd(residuals, dy):
    x, w, block_expert, num_active = residuals
    num_blocks, block, k_dim = x.shape
    dx_step = _per_block(num_active, lambda g, e: g @ w[e].T, (block, k_dim), x.dtype)
    dw_step = _per_block(num_active, lambda xb, g: xb.T @ g, w.shape[1:], jnp.float32)

    def body(dw, inputs):
        index, xb, g, e = inputs
        dw = dw.at[e].add(dw_step(index, xb, g))
        return dw, dx_step(index, g, e)

    dw, dx = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32),
                          (jnp.arange(num_blocks), x, dy, block_expert))
    return dx, dw.astype(w.dtype), None, None


block_grouped_matmul.defvjp(_fwd, _bwd)
