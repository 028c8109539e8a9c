"""Truncated importance sampling (TIS; Yao et al. 2025, the correction Step 3.5 monitors in its
asynchronous RL, report App. D.2.4, and MiMo-V2-Flash applies staleness-aware to partial
rollouts): the rollouts were sampled by pi_infer (an older policy, and the inference path's
numerics), the update is computed against pi_old (the training path before this iteration's
update), so each response token's loss term is weighted by

    w_t = min(pi_old(y_t) / pi_infer(y_t), C)        (a constant: no gradient)

with the cap C = `rl.tis_cap`. The weight multiplies the algorithm's per-token term (through
the losses' `select` weights, rl/objectives/losses.py), so it composes with every algorithm:
PPO's clipped ratio pi / pi_old, MIS-PO's filters (which drop tokens and trajectories whose
pi_old / pi_infer leaves their bounds before any weight applies), GSPO's sequence ratio.
"""

from __future__ import annotations

import jax.numpy as jnp

from rl.objectives.losses import masked_mean


def tis_weights(old_logp, infer_logp, mask, cap: float):
    """old_logp, infer_logp, mask: [B, T] -> (w [B, T], 0 off the response; stats): the
    `tis/truncation_rate` (share of response tokens whose ratio exceeds the cap), the
    `tis/mean_weight` and the `tis/ratio_mean` before truncation."""
    mask = mask.astype(jnp.float32)
    ratio = jnp.exp(jnp.where(mask > 0, old_logp - infer_logp, 0.0))
    weights = jnp.minimum(ratio, cap) * mask
    stats = {"tis/truncation_rate": masked_mean((ratio > cap).astype(jnp.float32), mask),
             "tis/mean_weight": masked_mean(weights, mask),
             "tis/ratio_mean": masked_mean(ratio, mask)}
    return weights, stats
