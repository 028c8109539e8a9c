"""Router math, pure functions in float32 (report 2.2 and eq. 1; docs/architecture.md,
"Exact semantics").

Selection uses the biased scores s + b (b: the non-trainable loss-free balancing bias); the
combine weights are the *unbiased* scores of the chosen experts, renormalised to sum 1 and
multiplied by the routed scaling factor.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from model.config import MoEConfig


class Routing(NamedTuple):
    indices: jax.Array  # [N, k] int32 chosen experts
    weights: jax.Array  # [N, k] float32 combine weights
    probs: jax.Array  # [N, E] float32 routing probabilities (rows sum to 1)


def route(logits: jax.Array, bias: jax.Array | None, cfg: MoEConfig) -> Routing:
    """logits: [N, E] float32; bias: [E] or None."""
    if cfg.router_activation == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        scores = probs = jax.nn.softmax(logits, axis=-1)
    selection = scores if bias is None else scores + jax.lax.stop_gradient(bias)
    _, indices = jax.lax.top_k(selection, cfg.top_k)
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if cfg.renormalize:
        weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-20)
    return Routing(indices.astype(jnp.int32), weights * cfg.routed_scaling_factor, probs)


def expert_load(indices: jax.Array, num_experts: int) -> jax.Array:
    """f_e of eq. 1: fraction of the N*k routed copies that go to expert e. [N, k] -> [E]."""
    counts = jnp.zeros((num_experts,), jnp.float32).at[indices.reshape(-1)].add(1.0)
    return counts / indices.size


def ep_group_balance_loss(load: jax.Array, mean_probs: jax.Array, num_groups: int) -> jax.Array:
    """Eq. 1: L_EP = G * sum_g f_g p_g over G contiguous expert groups (one per EP rank).

    load: f_e [E] (no gradient); mean_probs: p_e [E] (carries the gradient). Equals 1 when
    both are uniform.
    """
    f_g = jnp.sum(load.reshape(num_groups, -1), axis=-1)
    p_g = jnp.sum(mean_probs.reshape(num_groups, -1), axis=-1)
    return num_groups * jnp.sum(jax.lax.stop_gradient(f_g) * p_g)


def routing_confidence(probs: jax.Array, indices: jax.Array) -> jax.Array:
    """Σk of report 5.2.1: probability mass of the activated experts. [N, E], [N, k] -> [N]."""
    return jnp.sum(jnp.take_along_axis(probs, indices, axis=-1), axis=-1)
