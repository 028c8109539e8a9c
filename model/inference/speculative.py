"""Speculative decoding with the MTP heads (report 2.1-2.2): acceptance of drafted tokens.

Each step the main model verifies D drafted tokens in one forward pass over
[current token, d_1 .. d_D]. Draft d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i))
while every earlier draft was accepted; at the first rejection a token is drawn from the residual
norm(max(0, p_i - q_i)), and when all D are accepted a bonus token comes from p_{D+1}
(Leviathan et al. 2023; Chen et al. 2023). The committed tokens are then distributed exactly as
sampling from the main model one token at a time. With greedy decoding p and q are one-hot
(model/inference/sampling.py), so this reduces to "accept the longest prefix that equals the main
model's argmax, then append its argmax": the output equals plain greedy decoding.
"""

import jax
import jax.numpy as jnp

from model.inference.sampling import sample


def accept_drafts(key: jax.Array, target_probs: jax.Array, draft_probs: jax.Array,
                  drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """target_probs p: [B, D+1, V] (position i predicts the token after draft i, i = 0 before
    d_1); draft_probs q: [B, D, V]; drafts: [B, D] int, d_i ~ q_i.

    Returns (accepted [B] int32 in [0, D], committed [B, D+1] int32): committed[:, :a] are the
    accepted drafts, committed[:, a] the residual or bonus token, later entries are padding."""
    accept_key, residual_key = jax.random.split(key)
    batch, num_drafts = drafts.shape
    p_draft = jnp.take_along_axis(target_probs[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    uniform = jax.random.uniform(accept_key, (batch, num_drafts))
    accepted_each = uniform * q_draft < p_draft  # u < p/q without dividing by q
    accepted = jnp.sum(jnp.cumprod(accepted_each, axis=1), axis=1).astype(jnp.int32)

    rows = jnp.arange(batch)
    p_next = target_probs[rows, accepted]  # [B, V]
    q_next = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], 1)[rows, accepted]
    residual = jnp.maximum(p_next - q_next, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # p == q leaves no residual mass; rejection then has probability 0, so p itself is exact.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_next)
    last = sample(residual_key, residual)

    index = jnp.arange(num_drafts + 1)
    padded_drafts = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    committed = jnp.where(index < accepted[:, None], padded_drafts,
                          jnp.where(index == accepted[:, None], last[:, None], 0))
    return accepted, committed.astype(jnp.int32)
