"""The training path's view of rollouts: per-token log-probabilities and entropies of the
policy, routing confidence, and the critic (a value model of the policy's architecture).

Rollout arrays are [B, T] in token space: entry t concerns token t of the row, so
`logp[b, t]` = log pi(tokens[b, t] | tokens[b, :t]) (0 at t = 0) and `values[b, t]` = V(s_t),
the value of the state in which token t is chosen. Rows are [prompt; response; padding], with
`segment_ids` 1 on real tokens and 0 on padding.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import ModelConfig, MTPConfig
from model.lm import CausalLM, learned_routing_mean
from rl.distill.full_vocab import reverse_kl


def shift_right(x):
    """[B, T] -> [B, T] with x[:, t - 1] at t (0 at t = 0): predictions made at t - 1 belong to
    token t."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)


def token_logprobs(model: CausalLM, variables, tokens, segment_ids, temperature: float = 1.0,
                   chunk_size: int = 1024, teacher: tuple | None = None, routed_experts=None):
    """Policy log-probabilities of the given tokens, the entropy of each predictive
    distribution, and the per-token routing confidence Sigma_k (report 5.2.1).

    tokens, segment_ids: [B, T] -> dict of [B, T] float32 `logp`, `entropy` (of the
    distribution token t was drawn from, at `temperature`) and `routing_confidence` (mean over
    MoE layers of the routed probability mass at the position that chose token t; 1 without
    MoE). Logits are formed `chunk_size` positions at a time (remat in the backward pass), so
    no [B, T, V] array exists. `teacher` = (fn, hidden [B, T, D_t], teacher_id [B]) of the
    full-vocabulary distillation signal (rl/distill/full_vocab.py) adds `reverse_kl` [B, T]:
    KL(pi || pi_teacher) of the distribution token t was drawn from, in the same chunks.
    `routed_experts` [B, L_moe, T, k] (Rollout Routing Replay, rl/routing_replay.py) routes
    every MoE layer as the rollout did and adds `replay_mismatch` [B, T]: the share of the
    learned-routing layers whose own top-k for token t differs from the replayed experts."""
    routes = None if routed_experts is None else jnp.swapaxes(routed_experts, 0, 1)
    out = model.apply(variables, tokens, segment_ids, compute_logits=False, num_mtp_heads=0,
                      routed_experts=routes)
    batch, length, dim = out.hidden.shape
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], 1)
    rows = [out.hidden, targets]
    if teacher is not None:
        teacher_fn, teacher_hidden, teacher_id = teacher
        rows += [teacher_hidden, jnp.broadcast_to(teacher_id[:, None], (batch, length))]
    chunk = min(chunk_size, batch * length)
    pad = -batch * length % chunk
    n = (batch * length + pad) // chunk
    xs = [jnp.pad(x.reshape(batch * length, *x.shape[2:]),
                  ((0, pad),) + ((0, 0),) * (x.ndim - 2)).reshape(n, chunk, *x.shape[2:])
          for x in rows]

    @jax.checkpoint
    def score(h, t, *teacher_chunk):
        logits = model.apply(variables, h, method=CausalLM.project) / temperature
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        logp = jnp.take_along_axis(log_probs, t[:, None], axis=-1)[:, 0]
        entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
        if not teacher_chunk:
            return logp, entropy
        return logp, entropy, reverse_kl(log_probs, teacher_fn(*teacher_chunk))

    scores = jax.lax.map(lambda chunk_xs: score(*chunk_xs), tuple(xs))
    unflat = lambda x: shift_right(x.reshape(-1)[:batch * length].reshape(batch, length))  # noqa: E731
    moe = out.aux.get("moe")
    confidence = (jnp.mean(moe["routing_confidence"], axis=0) if moe is not None
                  else jnp.ones((batch, length), jnp.float32))
    result = {"logp": unflat(scores[0]), "entropy": unflat(scores[1]),
              "routing_confidence": shift_right(confidence)}
    if teacher is not None:
        result["reverse_kl"] = unflat(scores[2])
    if routes is not None:
        result["replay_mismatch"] = learned_routing_mean(model.config, moe["replay_mismatch"])
    return result


def critic_config(config: ModelConfig) -> ModelConfig:
    """The value model's backbone: the policy's architecture without MTP heads."""
    return config.replace(mtp=MTPConfig(num_heads=0, share_output_head=False))


class ValueModel(nn.Module):
    """Critic V_phi: the policy's backbone (own params) and a linear value head on the final
    normed hidden state. tokens, segment_ids [B, T] -> float32 [B, T]: entry t is the value of
    the state after token t, V(s_{t+1}); `shift_right` of it gives V(s_t) in token space."""

    config: ModelConfig

    def setup(self):
        self.backbone = CausalLM(critic_config(self.config))
        self.value_weight = self.param(
            "value_weight", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            (self.config.d_model,), jnp.float32)
        self.value_bias = self.param("value_bias", nn.initializers.zeros, (), jnp.float32)

    def __call__(self, tokens, segment_ids=None):
        out = self.backbone(tokens, segment_ids, compute_logits=False)
        return out.hidden.astype(jnp.float32) @ self.value_weight + self.value_bias


def critic_variables_from_policy(policy_variables: dict, critic_init: dict) -> dict:
    """Critic variables (structure of `critic_init`, unboxed `ValueModel.init` output) whose
    backbone is a copy of the policy's weights and whose value head is `critic_init`'s
    (zero-initialised: V = 0 at the start). The policy's MTP heads and LM head have no
    counterpart in the critic and are left out."""
    backbone = critic_init["params"]["backbone"]
    params = {**critic_init["params"],
              "backbone": {k: policy_variables["params"][k] for k in backbone}}
    out = {"params": params}
    if "balance" in critic_init:
        out["balance"] = {"backbone": policy_variables["balance"]}
    return out
