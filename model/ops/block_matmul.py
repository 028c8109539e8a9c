"""Grouped matmul over row blocks, each block owned by one expert (the CPU `sorted` MoE path).

x is split into `num_blocks` blocks of `block` rows; block b multiplies expert
`block_expert[b]`'s weight. Only the first `num_active` blocks hold rows. A `lax.scan` walks
the blocks `STEP_BLOCKS` at a time (one batched matmul per step: wide enough for XLA's CPU
matmul to use every core) and skips steps past `num_active` with `lax.cond`, so the static
worst-case block count needed for dropless routing costs little when routing is balanced. Each
step reads its blocks' expert weights in place (no [num_blocks, K, N] gather); the backward
pass accumulates the weight gradient per expert into one [E, K, N] carry (the "transposed
grouped matmul").
"""

import jax
import jax.numpy as jnp

STEP_BLOCKS = 8


def _steps(x, block_expert, step_blocks):
    """Pads the block axis to whole steps: x [nb, m, K] -> [S, P, m, K], experts -> [S, P]."""
    num_blocks = x.shape[0]
    pad = -num_blocks % step_blocks
    x = jnp.pad(x, ((0, pad), (0, 0), (0, 0)))
    block_expert = jnp.pad(block_expert, (0, pad), mode="edge")
    return x.reshape(-1, step_blocks, *x.shape[1:]), block_expert.reshape(-1, step_blocks)


def _scan_steps(step_fn, carry, num_active, step_blocks, zeros_out, *xs):
    """Runs step_fn(carry, block_ids, *step_inputs) -> (carry, out) for steps holding an active
    block; later steps keep the carry and emit zeros_out."""
    num_steps = xs[0].shape[0]
    block_ids = jnp.arange(num_steps * step_blocks).reshape(num_steps, step_blocks)

    def body(carry, inputs):
        ids = inputs[0]
        return jax.lax.cond(ids[0] < num_active, step_fn, lambda c, *_: (c, zeros_out),
                            carry, *inputs)

    return jax.lax.scan(body, carry, (block_ids, *xs))


def _forward(x, w, block_expert, num_active, step_blocks):
    """x: [nb, m, K], w: [E, K, N] -> [nb, m, N]."""
    num_blocks, block, _ = x.shape
    xs, experts = _steps(x, block_expert, step_blocks)
    live = lambda ids: (ids < num_active)[:, None, None]  # noqa: E731 (blocks past the end -> 0)

    def step(carry, ids, xb, e):
        return carry, jnp.where(live(ids), jnp.einsum("pmk,pkn->pmn", xb, w[e]), 0).astype(x.dtype)

    zeros = jnp.zeros((step_blocks, block, w.shape[2]), x.dtype)
    _, out = _scan_steps(step, None, num_active, step_blocks, zeros, xs, experts)
    return out.reshape(-1, block, w.shape[2])[:num_blocks]


def _block_grouped_matmul(x, w, block_expert, num_active):
    return _forward(x, w, block_expert, num_active, min(STEP_BLOCKS, x.shape[0]))


@jax.custom_vjp
def block_grouped_matmul(x, w, block_expert, num_active):
    """x: [nb, m, K]; w: [E, K, N]; block_expert: [nb] int32; num_active: int32 scalar.

    Returns [nb, m, N] with block b = x[b] @ w[block_expert[b]] for b < num_active, else 0.
    """
    return _block_grouped_matmul(x, w, block_expert, num_active)


def _fwd(x, w, block_expert, num_active):
    return _block_grouped_matmul(x, w, block_expert, num_active), (x, w, block_expert, num_active)


def _bwd(residuals, dy):
    x, w, block_expert, num_active = residuals
    num_blocks, block, k_dim = x.shape
    step_blocks = min(STEP_BLOCKS, num_blocks)
    dx = _forward(dy, jnp.swapaxes(w, 1, 2), block_expert, num_active, step_blocks)
    xs, experts = _steps(x, block_expert, step_blocks)
    dys, _ = _steps(dy, block_expert, step_blocks)

    def step(dw, ids, xb, g, e):
        live = (ids < num_active)[:, None, None]
        contribution = jnp.einsum("pmk,pmn->pkn", xb, g, preferred_element_type=jnp.float32)
        return dw.at[e].add(jnp.where(live, contribution, 0)), None

    dw, _ = _scan_steps(step, jnp.zeros(w.shape, jnp.float32), num_active, step_blocks, None,
                        xs, dys, experts)
    return dx.astype(x.dtype), dw.astype(w.dtype), None, None


block_grouped_matmul.defvjp(_fwd, _bwd)
