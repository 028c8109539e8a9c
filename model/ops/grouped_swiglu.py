"""Grouped SwiGLU over expert row ranges, in row chunks (the CPU `sorted` MoE path).

Rows come sorted by expert: expert e owns rows [starts[e], starts[e] + counts[e]). A loop over the
experts reads each expert's weights once and walks its rows in chunks of a few static sizes
(`chunk_sizes`, halving from `max_chunk`): the largest size while more than half of it remains,
then one chunk of the smallest size that covers the rest. Each chunk is one plain 2-D matmul per
projection, gate and up fused into one of width 2F; no rows are padded and no row is computed
twice, except that an expert's last chunk may run past its rows ("overflow", less than half that
chunk). Overflow rows belong to a later expert or to the buffer's tail: the forward pass writes
garbage there, overwritten when the loop reaches that expert (experts are walked in order), and
the backward pass zeroes their cotangent so they add nothing to the weight gradients. The caller
leaves the largest chunk's worth of rows as slack after the last expert, so no chunk runs off the
buffer.

Why chunks per expert (measured on XLA:CPU, 2 cores): the former design batched equal-size row
blocks of different experts in one einsum per loop step. That gathers every block's weights, and
keeping the per-expert padding small needs blocks of 64-128 rows, whose matmuls run at 60-80% of a
dense matmul's speed; 256-row chunks of one expert run at about its speed.

The backward pass (custom VJP) walks the same chunks: dx is written like the forward output, and
the weight gradients are added in place into the expert's slice of [E, ...] buffers (float32
or wider).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from model.ops.swiglu import SwiGLUClamp, swiglu_activation
from pallas_kernels.saved_names import EXPERT_GATE_UP

MIN_CHUNK = 8  # the smallest chunk when max_chunk allows it (matmuls below ~8 rows waste time)


def chunk_sizes(num_rows: int, max_chunk: int) -> tuple[int, ...]:
    """Descending chunk row counts: max_chunk (at most num_rows rounded up to a power of two),
    halving while the half is at least MIN_CHUNK (or while it is at least 1 when max_chunk is
    below MIN_CHUNK)."""
    largest = max(min(max_chunk, 1 << max(num_rows - 1, 0).bit_length()), 1)
    sizes = [largest]
    while sizes[-1] // 2 >= min(MIN_CHUNK, largest):
        sizes.append(sizes[-1] // 2)
    return tuple(sizes)


def _walk_experts(starts, counts, sizes, carry, expert_context, chunk_step):
    """Runs carry = chunk_step(size, context, row, remaining, carry) over every chunk, expert by
    expert in order, with context = expert_context(e) computed once per expert.

    Size sizes[i] is used while more than sizes[i + 1] rows of the expert remain (more than 0 for
    the last size), so the final chunk overflows the expert's rows by less than half its size.
    """

    def per_expert(expert, carry):
        context = expert_context(expert)
        start, count = starts[expert], counts[expert]
        done = jnp.zeros((), jnp.int32)
        for size, next_size in zip(sizes, sizes[1:] + (0,)):
            def more(state, next_size=next_size):
                return count - state[0] > next_size

            def step(state, size=size):
                done, carry = state
                return done + size, chunk_step(size, context, start + done, count - done, carry)

            done, carry = jax.lax.while_loop(more, step, (done, carry))
        return carry

    return jax.lax.fori_loop(0, starts.shape[0], per_expert, carry)


def _fused_gate_up(gate, up, expert):
    """[E, D, F] x2 -> expert's [D, 2F] (gate columns first)."""
    return jnp.concatenate([gate[expert], up[expert]], axis=-1)


def _forward(rows, gate, up, down, starts, counts, clamp, sizes, keep_gate_up):
    """-> (out [R, D], h_sq [R] and out_sq [R] float32, gate_up [R, 2F] pre-activations if
    keep_gate_up)."""
    num_rows, d_model = rows.shape
    hidden = down.shape[1]

    def expert_context(expert):
        return _fused_gate_up(gate, up, expert), down[expert]

    def chunk_step(size, context, row, remaining, buffers):
        w_gate_up, w_down = context
        x = jax.lax.dynamic_slice_in_dim(rows, row, size)
        gate_up = jnp.dot(x, w_gate_up).astype(rows.dtype)
        h = swiglu_activation(gate_up[:, :hidden], gate_up[:, hidden:], clamp)
        out = jnp.dot(h, w_down).astype(rows.dtype)
        results = (out, jnp.sum(jnp.square(h.astype(jnp.float32)), axis=-1),
                   jnp.sum(jnp.square(out.astype(jnp.float32)), axis=-1))
        results += (gate_up,) if keep_gate_up else ()
        return tuple(jax.lax.dynamic_update_slice_in_dim(buffer, value, row, 0)
                     for buffer, value in zip(buffers, results))

    buffers = (jnp.zeros((num_rows, d_model), rows.dtype), jnp.zeros((num_rows,), jnp.float32),
               jnp.zeros((num_rows,), jnp.float32))
    if keep_gate_up:
        buffers += (jnp.zeros((num_rows, 2 * hidden), rows.dtype),)
    return _walk_experts(starts, counts, sizes, buffers, expert_context, chunk_step)


def _add_to_expert(buffer, expert, value):
    """buffer[expert] += value, in place."""
    current = jax.lax.dynamic_index_in_dim(buffer, expert, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, current + value, expert, 0)


def _backward(rows, gate_up, d_out, gate, up, down, starts, counts, clamp, sizes):
    """-> (d_rows [R, D], d_gate, d_up, d_down in at least float32)."""
    hidden = down.shape[1]
    accumulate = jnp.promote_types(gate.dtype, jnp.float32)  # weight gradients are sums of chunks

    def expert_context(expert):
        return expert, _fused_gate_up(gate, up, expert), down[expert]

    def chunk_step(size, context, row, remaining, grads):
        expert, w_gate_up, w_down = context
        d_rows, d_gate, d_up, d_down = grads
        x, pre = (jax.lax.dynamic_slice_in_dim(a, row, size) for a in (rows, gate_up))
        own_rows = (jnp.arange(size) < remaining)[:, None]  # overflow rows get no cotangent
        g = jnp.where(own_rows, jax.lax.dynamic_slice_in_dim(d_out, row, size), 0)
        h, activation_vjp = jax.vjp(lambda a, b: swiglu_activation(a, b, clamp),
                                    pre[:, :hidden], pre[:, hidden:])
        d_down = _add_to_expert(d_down, expert, jnp.dot(h.T, g, preferred_element_type=accumulate))
        d_h = jnp.dot(g, w_down.T).astype(rows.dtype)
        d_pre = jnp.concatenate(activation_vjp(d_h), axis=-1)
        d_x = jnp.dot(d_pre, w_gate_up.T).astype(rows.dtype)
        d_w = jnp.dot(x.T, d_pre, preferred_element_type=accumulate)
        d_gate = _add_to_expert(d_gate, expert, d_w[:, :hidden])
        d_up = _add_to_expert(d_up, expert, d_w[:, hidden:])
        return jax.lax.dynamic_update_slice_in_dim(d_rows, d_x, row, 0), d_gate, d_up, d_down

    grads = (jnp.zeros_like(rows),) + tuple(jnp.zeros(w.shape, accumulate)
                                            for w in (gate, up, down))
    return _walk_experts(starts, counts, sizes, grads, expert_context, chunk_step)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def grouped_swiglu(rows, gate, up, down, starts, counts, clamp: SwiGLUClamp, sizes):
    """SwiGLU of each expert on its rows: rows [R, D] sorted by expert, with at least sizes[0]
    rows of slack after the last expert's; gate/up [E, D, F], down [E, F, D]; starts/counts [E]
    int32; clamp: the SwiGLU's (static); sizes from `chunk_sizes`.

    Returns (out [R, D], h_sq [R] and out_sq [R] float32: squared norms of each row's SwiGLU
    intermediate and output, which get no gradient). Rows outside every expert's range hold
    unspecified values. out_sq is summed in the loop, while each output chunk is at hand: the
    monitors then need no [R, D] output, which XLA could otherwise keep alive until the end of
    the step for them (`python -m train.plan --measure` showed it, 8 MiB per MoE layer of the
    tiny model at d_model 256 and 2048 tokens per device, four times that with mesh.expert=4).
    """
    return _forward(rows, gate, up, down, starts, counts, clamp, sizes, False)


def _grouped_swiglu_fwd(rows, gate, up, down, starts, counts, clamp, sizes):
    out, h_sq, out_sq, gate_up = _forward(rows, gate, up, down, starts, counts, clamp, sizes,
                                          True)
    gate_up = checkpoint_name(gate_up, EXPERT_GATE_UP)
    return (out, h_sq, out_sq), (rows, gate_up, gate, up, down, starts, counts)


def _grouped_swiglu_bwd(clamp, sizes, residuals, cotangents):
    rows, gate_up, gate, up, down, starts, counts = residuals
    d_out, _, _ = cotangents  # h_sq and out_sq feed only statistics
    d_rows, *d_weights = _backward(rows, gate_up, d_out, gate, up, down, starts, counts, clamp,
                                   sizes)
    d_gate, d_up, d_down = (d.astype(w.dtype) for d, w in zip(d_weights, (gate, up, down)))
    return d_rows, d_gate, d_up, d_down, None, None


grouped_swiglu.defvjp(_grouped_swiglu_fwd, _grouped_swiglu_bwd)
