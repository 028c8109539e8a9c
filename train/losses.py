"""Training losses: chunked float32 next-token cross-entropy, MTP losses, EP balance loss.

The LM head is applied chunk by chunk inside a rematerialised scan, so neither the forward nor
the backward pass holds [B, T, V] logits for the whole batch (only [chunk, V] at a time).
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


class Targets(NamedTuple):
    tokens: jax.Array  # [B, T] int32: the token each position predicts
    weights: jax.Array  # [B, T] float32: 1 where that prediction enters the loss


def shifted_targets(tokens, segment_ids, meta_mask, offset: int, mask_meta) -> Targets:
    """Targets `offset` tokens ahead (1 = next token; MTP head h uses 1 + h).

    tokens, segment_ids (0 = padding), meta_mask: [B, T]. A position is trained only when its
    target lies in the same document. `mask_meta` (bool scalar, may be traced) drops targets
    that are metadata tokens (report A.3, eq. 8: M stays in context but leaves the loss).
    """
    tokens, segment_ids, meta_mask = (jnp.asarray(x) for x in (tokens, segment_ids, meta_mask))
    length = tokens.shape[1]

    def ahead(x, fill):
        pad = jnp.full((x.shape[0], offset), fill, x.dtype)
        return jnp.concatenate([x[:, offset:], pad], axis=1)[:, :length]

    target_segments = ahead(segment_ids, 0)
    valid = (segment_ids > 0) & (target_segments == segment_ids)
    valid &= ~(mask_meta & ahead(meta_mask, False))
    return Targets(ahead(tokens, 0), valid.astype(jnp.float32))


def chunked_cross_entropy(project: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                          targets: Targets, chunk_size: int) -> tuple[jax.Array, jax.Array]:
    """Weighted cross-entropy summed over positions, in float32, `chunk_size` positions at a time.

    project: normed hidden [n, D] -> logits [n, V]; hidden: [B, T, D].
    Returns (sum of weighted token losses, sum of weights), both float32 scalars.
    """
    dim = hidden.shape[-1]
    flat = hidden.reshape(-1, dim)
    tokens, weights = targets.tokens.reshape(-1), targets.weights.reshape(-1)
    chunk = min(chunk_size, flat.shape[0])
    pad = -flat.shape[0] % chunk
    flat = jnp.pad(flat, ((0, pad), (0, 0)))
    tokens, weights = jnp.pad(tokens, (0, pad)), jnp.pad(weights, (0, pad))

    @jax.checkpoint  # recompute each chunk's logits in the backward pass instead of storing them
    def chunk_loss(h, t, w):
        logits = project(h).astype(jnp.float32)
        target_logit = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - target_logit) * w)

    def body(total, xs):
        return total + chunk_loss(*xs), None

    n = flat.shape[0] // chunk
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                            (flat.reshape(n, chunk, dim), tokens.reshape(n, chunk),
                             weights.reshape(n, chunk)))
    return total, jnp.sum(weights)
