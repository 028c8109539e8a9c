"""Plain-jnp references for the Pallas kernels: the slow, obviously-correct definitions.

Each reference is written straight from the spec (the attention and MoE semantics of
docs/architecture.md), shares no code with the kernels or with `model/`, and computes in float32.
Tests compare kernels against these and against the model's XLA paths; autodiff of a reference is
the reference gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# ================================================================================================
# Attention (causal full / sliding window, GQA, segment ids, per-head sink)
# ================================================================================================


def attention_mask(length: int, window: int | None, segment_ids: jax.Array | None) -> jax.Array:
    """[B or 1, T, T] bool: query i sees key j iff j <= i, i - j < window, same segment."""
    i = jnp.arange(length)[:, None]
    j = jnp.arange(length)[None, :]
    mask = j <= i
    if window is not None:
        mask = mask & (i - j < window)
    mask = mask[None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask


def attention_reference(q, k, v, *, window=None, segment_ids=None, sink=None):
    """q: [B, T, H, D], k/v: [B, T, K, D] -> [B, T, H, D] in q.dtype; softmax(q k^T / sqrt(D)).

    GQA by explicit repetition (query head h uses KV head h // G). The sink is one extra logit
    per head, `sink[h]`, appended to every query's row with a zero value vector, so it only
    adds exp(sink) to the softmax denominator.
    """
    batch, length, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    k = jnp.repeat(k.astype(jnp.float32), groups, axis=2)
    v = jnp.repeat(v.astype(jnp.float32), groups, axis=2)
    hp = jax.lax.Precision.HIGHEST  # true float32 matmuls on every backend
    scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k, precision=hp)
    scores = scores / jnp.sqrt(head_dim)
    mask = attention_mask(length, window, segment_ids)[:, None]  # [B, 1, T, T]
    scores = jnp.where(mask, scores, -jnp.inf)
    if sink is not None:
        sink_column = jnp.broadcast_to(
            sink.astype(jnp.float32)[None, :, None, None], (batch, heads, length, 1)
        )
        probs = jax.nn.softmax(jnp.concatenate([scores, sink_column], axis=-1), axis=-1)
        probs = probs[..., :length]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=hp).astype(q.dtype)


# ================================================================================================
# MoE references (grouped matmuls).
# ================================================================================================


def _group_row_masks(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """[E, M] bool: row r belongs to group g iff start_g <= r < start_g + size_g."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    rows = jnp.arange(num_rows)
    return (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])


def gmm_reference(lhs, rhs, group_sizes):
    """lhs [M, K] (rows sorted by group), rhs [E, K, N] -> [M, N] float32.

    Row r of group g is lhs[r] @ rhs[g]; rows past sum(group_sizes) are 0. One full matmul
    per group, masked to the group's rows.
    """
    masks = _group_row_masks(group_sizes, lhs.shape[0])
    out = jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)
    for g in range(rhs.shape[0]):
        full = jnp.dot(lhs.astype(jnp.float32), rhs[g].astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
        out = jnp.where(masks[g][:, None], full, out)
    return out


def tgmm_reference(lhs, rhs, group_sizes):
    """lhs [M, K], rhs [M, N] -> [E, K, N] float32: out[g] = lhs[rows of g].T @ rhs[rows of g]."""
    masks = _group_row_masks(group_sizes, lhs.shape[0])
    outs = []
    for g in range(group_sizes.shape[0]):
        x = jnp.where(masks[g][:, None], lhs.astype(jnp.float32), 0.0)
        outs.append(jnp.dot(x.T, rhs.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST))
    return jnp.stack(outs)


def moe_ffn_reference(x, indices, gate, up, down, limit):
    """Routed experts copy by copy: x [N, D], indices [N, k], gate/up [E, D, F], down [E, F, D]
    -> [N, k, D] float32, copy (n, j) = SwiGLU of expert indices[n, j] applied to x[n].

    SwiGLU with the clamp of report 4.1.3 (limit L > 0): min(silu(x W_g), L) * clip(x W_u, -L, L).
    """
    hp = jax.lax.Precision.HIGHEST
    x = x.astype(jnp.float32)
    gate_pre = jnp.einsum("nd,nkdf->nkf", x, gate[indices].astype(jnp.float32), precision=hp)
    up_pre = jnp.einsum("nd,nkdf->nkf", x, up[indices].astype(jnp.float32), precision=hp)
    g = gate_pre * jax.nn.sigmoid(gate_pre)
    if limit > 0:
        g = jnp.minimum(g, limit)
        up_pre = jnp.clip(up_pre, -limit, limit)
    return jnp.einsum("nkf,nkfd->nkd", g * up_pre, down[indices].astype(jnp.float32), precision=hp)
