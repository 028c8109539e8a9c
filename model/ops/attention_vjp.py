"""Masked GQA attention on head-major blocks with a hand-written VJP: the kernel of the `xla`
attention core (model/ops/attention_cores.py builds the blocks and the masks).

A block is one batch row (or query chunk) and one KV head: q [G·T, D] holds the G query heads
sharing that KV head stacked along the rows, k/v [S, D], mask [T, S] (shared by the G heads).
Scores and probabilities are [G·T, S], rows-major everywhere. Why by hand (XLA:CPU):
- Autodiff of the einsums contracts the probabilities over their rows for dK and dV, so XLA
  transposes the [T, S] tensors and fuses those transposes into the softmax-backward loops,
  which then run several times slower than the matmuls. Here dKᵀ = qᵀ·dS and dVᵀ = dOᵀ·P:
  only [rows, D] operands are transposed, never a [T, S] one.
- The probabilities are recomputed in the backward pass from the saved log-sum-exp (one more
  q·kᵀ) instead of being saved: no [T, S] residual, which a scan over layers would stack.
- `lax.map` runs the blocks a few at a time, so each step's [G·T, S] tensors stay in cache
  between the matmuls and elementwise passes that read them (2-3x faster on CPU than passes
  over the whole batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.parallel.mesh import global_view
from pallas_kernels.saved_names import name_attention

_NEG = -1e30  # finite "minus infinity": keeps gradients NaN-free on fully masked entries
_SCORES_PER_STEP = 1 << 18  # scores per `lax.map` step (1 MiB of float32), at least one block


@jax.custom_vjp
def grouped_attention(q, k, v, mask, sink):
    """q: [L, G·T, D] (row g·T + t: query head g of the block at position t); k: [L, S, D];
    v: [L, S, Dv] (-> [L, G·T, Dv]);
    mask: [L, T, S] bool (query t sees key s); sink: [L, G] float32 or None (exp(sink) is added
    to the softmax denominator of head g) -> [L, G·T, D] in q.dtype. Softmax in float32; a
    fully masked row gives zeros and NaN-free gradients."""
    return _forward(q, k, v, mask, sink)[0]


def _forward(q, k, v, mask, sink):
    out, lse = _blockwise(_block_forward, q, k, v, mask, sink)
    out, lse = name_attention(out, lse)  # for remat_policy=dots_with_kernels
    return out.astype(q.dtype), (q, k, v, mask, sink, out, lse)


def _backward(residuals, d_out):
    q, k, v, mask, sink, out, lse = residuals
    dq, dk, dv, d_sink = _blockwise(_block_backward, q, k, v, mask, sink, out, lse, d_out)
    return dq, dk, dv, None, d_sink


grouped_attention.defvjp(_forward, _backward)


def _blockwise(block_fn, q, k, *rest):
    """block_fn over the leading (block) axis in `lax.map` steps of ~_SCORES_PER_STEP scores.
    In the global view of a device mesh the block axis may be sharded (it holds the batch), and
    a loop over a sharded axis would gather it onto every device: there it runs as one step
    (inside a `shard_map` the blocks are the device's own)."""
    num_blocks, rows, keys = q.shape[0], q.shape[1], k.shape[1]
    per_step = max(1, _SCORES_PER_STEP // (rows * keys))
    if per_step >= num_blocks or global_view():
        return block_fn(q, k, *rest)
    return jax.lax.map(lambda args: block_fn(*args), (q, k, *rest), batch_size=per_step)


def _scaled_scores(q, k, mask):
    """q [..., G·T, D], k [..., S, D], mask [..., T, S] -> q·kᵀ/√D [..., G, T, S] float32."""
    scores = jnp.einsum("...rd,...sd->...rs", q, k, preferred_element_type=jnp.float32)
    scores = scores * q.shape[-1] ** -0.5
    return scores.reshape(*scores.shape[:-2], -1, *mask.shape[-2:])


def _rows(x):
    """[..., G, T, S] -> [..., G·T, S]."""
    return x.reshape(*x.shape[:-3], -1, x.shape[-1])


def _block_forward(q, k, v, mask, sink):
    """-> out [..., G·T, D] float32 and the log-sum-exp [..., G, T] (sink included)."""
    mask = mask[..., None, :, :]  # broadcast over the G heads
    scores = jnp.where(mask, _scaled_scores(q, k, mask), _NEG)
    row_max = jnp.max(scores, axis=-1)
    if sink is not None:
        row_max = jnp.maximum(row_max, sink[..., None])
    weights = jnp.where(mask, jnp.exp(scores - row_max[..., None]), 0.0)
    denominator = jnp.sum(weights, axis=-1)
    if sink is not None:
        denominator = denominator + jnp.exp(sink[..., None] - row_max)
    denominator = jnp.maximum(denominator, jnp.finfo(jnp.float32).tiny)
    # Normalising the [rows, D] output rather than the [rows, S] weights saves a pass.
    unnormalised = jnp.einsum("...rs,...sd->...rd", _rows(weights).astype(v.dtype), v,
                              preferred_element_type=jnp.float32)
    out = unnormalised / denominator.reshape(*unnormalised.shape[:-1], 1)
    return out, row_max + jnp.log(denominator)


def _block_backward(q, k, v, mask, sink, out, lse, d_out):
    """-> dq, dk, dv (in the inputs' dtypes), d_sink [..., G] or None.
    With P the probabilities, dP = dO·vᵀ and Δ = rowsum(dO∘O) = rowsum(P∘dP):
    dS = P∘(dP - Δ) (zero where masked, as P is), d_sink = -Σ_t P_sink·Δ."""
    mask = mask[..., None, :, :]
    probs = _rows(jnp.where(mask, jnp.exp(_scaled_scores(q, k, mask) - lse[..., None]), 0.0))
    delta = jnp.sum(d_out.astype(jnp.float32) * out, axis=-1)  # [..., G·T]
    d_probs = jnp.einsum("...rd,...sd->...rs", d_out, v, preferred_element_type=jnp.float32)
    d_scores = probs * (d_probs - delta[..., None])
    scale = q.shape[-1] ** -0.5
    dq = scale * jnp.einsum("...rs,...sd->...rd", d_scores.astype(k.dtype), k,
                            preferred_element_type=jnp.float32)
    # dK and dV contract over the rows: transpose the small [rows, D] operand, not dS or P.
    dk = scale * _transposed_product(q, d_scores)
    dv = _transposed_product(d_out, probs)
    d_sink = None
    if sink is not None:
        sink_probs = jnp.exp(sink[..., None] - lse)  # [..., G, T]
        d_sink = -jnp.sum(sink_probs * delta.reshape(lse.shape), axis=-1)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_sink


def _transposed_product(a, b):
    """a [..., R, D], b [..., R, S] float32 -> (aᵀ·b)ᵀ [..., S, D] float32. In float32 for any
    a.dtype: XLA:CPU runs this matmul on a fallback kernel that has no bf16·bf16 -> f32."""
    product = jnp.einsum("...dr,...rs->...ds", jnp.swapaxes(a.astype(jnp.float32), -1, -2), b)
    return jnp.swapaxes(product, -1, -2)
