"""Rollout Routing Replay (R3; MiMo-V2-Flash's RL infrastructure, after Ma et al. 2025): the
training path routes every rollout token to the experts the inference path chose for it.

With `rl.routing_replay=true` the decoder records, for every token it feeds through the model
(prompt and response but the last token), the experts of each MoE layer
(`Rollouts.routed_experts`, [B, L_moe, T, k]); the training forwards of the policy replay them:
pi_old's scoring pass and every actor minibatch update. Only the choice is replayed: the combine
weights are the current router's scores at the replayed experts (renormalised and scaled), so
the router keeps learning through them (model/layers/router.py, "Replayed routing"; the source
leaves this open, the R3 paper and Megatron-LM's routing replay do the same). Tokens without a
record (the last one of each row, padding) route themselves. The reference policy, the critic
and distillation teachers are other models and route themselves. Hash-routed layers have
nothing to replay: their table decides.

Metrics (`replay/...` per iteration, from the pi_old pass; `actor/replay_...` averaged over the
actor's minibatches, where the policy moves away from the rollout's):
- `topk_mismatch`: share of (recorded token, learned-routing layer) pairs whose recomputed
  top-k differs from the rollout's, i.e. the routing inconsistency R3 removes;
- `token_mismatch`: share of recorded tokens with such a difference in any layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl.objectives.losses import masked_mean


def replay_metrics(mismatch: jax.Array, routed_experts: jax.Array, mask: jax.Array
                   ) -> dict[str, jax.Array]:
    """mismatch [B, T] (share of learned layers whose own top-k differs, `token_logprobs`), the
    replayed experts [B, L_moe, T, k] and the response mask [B, T] -> {topk_mismatch,
    token_mismatch} scalars over the recorded tokens of the rows with a response (a padding
    row of a minibatch, rl/update.py, has none)."""
    rows = jnp.any(mask > 0, axis=1, keepdims=True)
    recorded = ((routed_experts[:, 0, :, 0] >= 0) & rows).astype(jnp.float32)
    return {"topk_mismatch": masked_mean(mismatch, recorded),
            "token_mismatch": masked_mean((mismatch > 0).astype(jnp.float32), recorded)}
