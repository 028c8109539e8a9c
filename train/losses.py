"""Training losses: chunked float32 next-token cross-entropy, MTP losses, EP balance loss.

The LM head is applied chunk by chunk inside a scan, so neither the forward nor the backward
pass holds [B, T, V] logits for the whole batch (only [chunk, V] at a time); under
differentiation each chunk's gradients are formed in the same pass (three head-sized matmuls per
chunk instead of four with rematerialised logits).
"""

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from model.parallel.mesh import logical_spec, mesh_axis_size, spec_axes


class Targets(NamedTuple):
    tokens: jax.Array  # [B, T] int32: the token each position predicts
    weights: jax.Array  # [B, T] float32: 1 where that prediction enters the loss


def shifted_targets(tokens, segment_ids, meta_mask, offset: int, mask_meta,
                    loss_mask=None) -> Targets:
    """Targets `offset` tokens ahead (1 = next token; MTP head h uses 1 + h).

    tokens, segment_ids (0 = padding), meta_mask, loss_mask: [B, T]. A position is trained only
    when its target lies in the same document and is a `loss_mask` token (None: every token;
    a chat's assistant turns under train.loss_mask=assistant, so a prompt token is context but
    never a target). `mask_meta` (bool scalar, may be traced) drops targets that are metadata
    tokens (report A.3, eq. 8: M stays in context but leaves the loss).
    """
    tokens, segment_ids, meta_mask = (jnp.asarray(x) for x in (tokens, segment_ids, meta_mask))
    length = tokens.shape[1]

    def ahead(x, fill):
        pad = jnp.full((x.shape[0], offset), fill, x.dtype)
        return jnp.concatenate([x[:, offset:], pad], axis=1)[:, :length]

    target_segments = ahead(segment_ids, 0)
    valid = (segment_ids > 0) & (target_segments == segment_ids)
    valid &= ~(mask_meta & ahead(meta_mask, False))
    if loss_mask is not None:
        valid &= ahead(jnp.asarray(loss_mask, bool), False)
    return Targets(ahead(tokens, 0), valid.astype(jnp.float32))


def chunked_cross_entropy(project: Callable[[Any, jax.Array], jax.Array], head_params: Any,
                          hidden: jax.Array, targets: Targets, chunk_size: int
                          ) -> tuple[jax.Array, jax.Array]:
    """Weighted cross-entropy summed over positions, in float32, about `chunk_size` positions
    per device at a time.

    project: (head_params, normed hidden [n, D]) -> logits [n, V]; hidden: [B, T, D]; the loss
    is differentiable in `head_params` and `hidden`.
    Returns (sum of weighted token losses, sum of weights), both float32 scalars.

    Under a mesh the rows are split over the batch axes and each row's tokens over `context`:
    every step of the chunk loop takes c tokens from each context piece and each row
    ([S, B, c], S the `context` size; in that order they flatten without moving), so each
    device works on its own tokens. A loop over one flat token axis would have to gather it
    onto every device first.
    """
    batch, length, dim = hidden.shape
    pieces = mesh_axis_size("context")
    rows_here = batch // _batch_shards(batch)
    piece = length // pieces
    chunk = max(1, min(piece, chunk_size // rows_here))
    steps = -(-piece // chunk)

    def chunked(x, fill=0):  # [B, T, ...] -> [n, S, B, c, ...]
        x = x.reshape(batch, pieces, piece, *x.shape[2:])
        widths = [(0, 0)] * x.ndim
        widths[2] = (0, steps * chunk - piece)
        x = jnp.pad(x, widths, constant_values=fill)
        x = x.reshape(batch, pieces, steps, chunk, *x.shape[3:])
        x = jnp.moveaxis(jnp.swapaxes(x, 0, 1), 2, 0)
        if jax.sharding.get_abstract_mesh().empty:
            return x
        spec = P(None, logical_spec("length")[0], logical_spec("batch")[0])
        return jax.lax.with_sharding_constraint(x, spec)

    total = _summed_loss(project, head_params, chunked(hidden), chunked(targets.tokens),
                         chunked(targets.weights))
    return total, jnp.sum(targets.weights)


def _batch_shards(batch: int) -> int:
    """Devices the rows split over under the current mesh and rules (the batch axes whose
    running product divides `batch`, as the rules table places them)."""
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1
    for axis in spec_axes(logical_spec("batch")[0]) if not mesh.empty else ():
        if batch % (shards * mesh.shape[axis]) == 0:
            shards *= mesh.shape[axis]
    return shards


def _chunk_loss(project, params, h, t, w):
    """Weighted cross-entropy of one chunk: h [..., D], t/w [...] -> float32 scalar."""
    h, t, w = h.reshape(-1, h.shape[-1]), t.reshape(-1), w.reshape(-1)
    logits = project(params, h).astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
    return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - target_logit) * w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _summed_loss(project, params, hidden, tokens, weights):
    """Sum of `_chunk_loss` over chunks: hidden [n, ..., D], tokens/weights [n, ...]."""
    def body(total, xs):
        return total + _chunk_loss(project, params, *xs), None

    return jax.lax.scan(body, jnp.zeros((), jnp.float32), (hidden, tokens, weights))[0]


def _summed_loss_fwd(project, params, hidden, tokens, weights):
    """The loss and, in the same pass over the chunks, its gradients (the backward only scales
    them): each chunk's logits are formed once, where rematerialising them for the backward
    would cost a fourth vocabulary-sized matmul per chunk. The head's gradient is summed over
    the chunks in float32 whatever the params' dtype (bfloat16 under mixed precision would
    round every partial sum) and rounded to it once, in the backward."""
    chunk_grad = jax.value_and_grad(_chunk_loss, argnums=(1, 2))

    def body(carry, xs):
        total, d_params = carry
        loss, (dp, dh) = chunk_grad(project, params, *xs)
        return (total + loss, jax.tree.map(lambda a, b: a + b.astype(a.dtype), d_params, dp)), dh

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)),
                         params)
    (total, d_params), d_hidden = jax.lax.scan(
        body, (jnp.zeros((), jnp.float32), zeros), (hidden, tokens, weights))
    dtypes = jax.tree.map(lambda p: jnp.zeros((0,), p.dtype), params)  # the params' dtypes
    return total, (d_params, d_hidden, dtypes)


def _summed_loss_bwd(project, residuals, g):
    d_params, d_hidden, dtypes = residuals
    d_params = jax.tree.map(lambda d, t: (d * g).astype(t.dtype), d_params, dtypes)
    return d_params, (d_hidden * g).astype(d_hidden.dtype), None, None


_summed_loss.defvjp(_summed_loss_fwd, _summed_loss_bwd)
