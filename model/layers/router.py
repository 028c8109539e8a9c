"""Router math, pure functions in float32 (report 2.2 and eq. 1; docs/architecture.md,
"Exact semantics"; DeepSeek-V4 report 2.1 for `sqrt_softplus` and the sequence-wise loss).

Selection uses the biased scores s + b (b: the non-trainable loss-free balancing bias); the
combine weights are the *unbiased* scores of the chosen experts, renormalised to sum 1 and
multiplied by the routed scaling factor.

Replayed routing (docs/architecture.md, "Exact semantics"): the experts may come from outside, as
MiMo-V2-Flash's Rollout Routing Replay (R3) uses the rollout's choice in the training forward and
DeepSeek-V4's anticipatory routing (report 4.2.3) the choice of parameters some steps old. Only
the choice is replayed: the combine weights are the current router's unbiased scores at the
replayed experts, renormalised and scaled as above, so the gradient still reaches the router
through them (as in the R3 paper and Megatron-LM's routing replay).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from model.config import MoEConfig


class Routing(NamedTuple):
    indices: jax.Array  # [N, k] int32 experts the tokens go to
    weights: jax.Array  # [N, k] float32 combine weights
    probs: jax.Array  # [N, E] float32 routing probabilities (rows sum to 1)
    # [N, k] int32 the router's own top-k: `indices` unless a replayed choice replaced it
    own_choice: jax.Array


def sqrt_softplus(logits: jax.Array) -> jax.Array:
    """sqrt(softplus(x)), DeepSeek-V4's affinity (report 2.1). Any shape in, same out.

    softplus underflows to 0 below x ~ -88 in float32, where d sqrt/du = inf times a zero
    softplus' gives NaN; flooring at the smallest normal float keeps the gradient finite and
    moves the value by < 1.1e-19.
    """
    softplus = jax.nn.softplus(logits)
    return jnp.sqrt(jnp.maximum(softplus, jnp.finfo(softplus.dtype).tiny))


def affinity_scores(logits: jax.Array, activation: str) -> tuple[jax.Array, jax.Array]:
    """logits: [N, E] -> (scores s [N, E], probs [N, E] with rows summing to 1).

    For sigmoid and sqrt_softplus the probabilities are the scores normalised over all experts,
    s' = s / sum_j s_j (the P_i of DeepSeek-V3's sequence-wise balance loss); for softmax the
    scores already are probabilities.
    """
    if activation == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        return probs, probs
    scores = jax.nn.sigmoid(logits) if activation == "sigmoid" else sqrt_softplus(logits)
    return scores, scores / jnp.sum(scores, axis=-1, keepdims=True)


def combine_weights(scores: jax.Array, indices: jax.Array, cfg: MoEConfig) -> jax.Array:
    """Unbiased scores of the chosen experts, renormalised and scaled. [N, E], [N, k] -> [N, k]."""
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if cfg.renormalize:
        weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-20)
    return weights * cfg.routed_scaling_factor


def limit_to_groups(selection: jax.Array, num_groups: int, topk_groups: int) -> jax.Array:
    """DeepSeek-V3's group-limited routing: the E experts form `num_groups` contiguous groups;
    a group scores the sum of its two highest selection scores, and experts outside the best
    `topk_groups` groups drop to -inf. [N, E] -> [N, E]."""
    tokens, num_experts = selection.shape
    grouped = selection.reshape(tokens, num_groups, num_experts // num_groups)
    group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0], axis=-1)
    _, best = jax.lax.top_k(group_scores, topk_groups)  # [N, topk_groups]
    keep = jnp.zeros((tokens, num_groups), bool).at[jnp.arange(tokens)[:, None], best].set(True)
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(tokens, num_experts)


@jax.named_scope("router")  # profile attribution (benchmarks/gpu/profiling.py)
def route(logits: jax.Array, bias: jax.Array | None, cfg: MoEConfig,
          replayed: jax.Array | None = None) -> Routing:
    """logits: [N, E] float32; bias: [E] or None; replayed: [N, k] int experts to use instead
    of the router's top-k (`with_replayed`; None: the router's own)."""
    scores, probs = affinity_scores(logits, cfg.router_activation)
    selection = scores if bias is None else scores + jax.lax.stop_gradient(bias)
    if cfg.topk_groups < cfg.num_groups:
        selection = limit_to_groups(selection, cfg.num_groups, cfg.topk_groups)
    _, own = jax.lax.top_k(selection, cfg.top_k)
    own = own.astype(jnp.int32)
    indices = own if replayed is None else with_replayed(replayed, own)
    return Routing(indices, combine_weights(scores, indices, cfg), probs, own)


def with_replayed(replayed: jax.Array, own: jax.Array) -> jax.Array:
    """The replayed experts [N, k] where a token has them; a token whose row holds a negative
    entry (nothing recorded, e.g. padding) keeps its own choice `own` [N, k]. -> [N, k] int32."""
    recorded = jnp.all(replayed >= 0, axis=-1, keepdims=True)
    return jnp.where(recorded, replayed, own).astype(jnp.int32)


def choices_differ(a: jax.Array, b: jax.Array) -> jax.Array:
    """Whether two top-k choices [N, k] name different sets of experts (slot order aside). -> [N]
    bool."""
    return jnp.any(jnp.sort(a, axis=-1) != jnp.sort(b, axis=-1), axis=-1)


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


def sequence_balance_loss(probs: jax.Array, indices: jax.Array) -> jax.Array:
    """DeepSeek-V4's sequence-wise balance loss (report 2.1, weight 1e-4 in 4.2.2), in
    DeepSeek-V3's form: per sequence, L = sum_i f_i P_i with f_i = E/(kT) sum_t 1[i chosen at t]
    and P_i = (1/T) sum_t s'_{i,t}; averaged over the B sequences. Equals 1 when uniform.

    probs: s' [B, T, E] (carries the gradient); indices: the chosen experts [B, T, k]. The
    caller multiplies by the loss weight. Hash-routed layers have a fixed choice and are left
    out, as transformers records router logits of its learned-selection routers only.
    """
    num_experts = probs.shape[-1]
    load = jax.vmap(expert_load, (0, None))(indices, num_experts)  # f_i / E, [B, E]
    mean_probs = jnp.mean(probs, axis=1)  # P_i, [B, E]
    per_sequence = num_experts * jnp.sum(jax.lax.stop_gradient(load) * mean_probs, axis=-1)
    return jnp.mean(per_sequence)


def routing_confidence(probs: jax.Array, indices: jax.Array) -> jax.Array:
    """Σk of report 5.2.1: probability mass of the activated experts. [N, E], [N, k] -> [N]."""
    return jnp.sum(jnp.take_along_axis(probs, indices, axis=-1), axis=-1)
