"""Estimators of KL(pi_theta || pi_ref), the penalty towards the reference (initial) policy,
from the tokens of sampled responses (`rl.kl_estimator`, times `rl.kl_coef`).

| `rl.kl_estimator` | per-token term, r = pi_ref / pi_theta | unbiased on tokens sampled from |
|---|---|---|
| `k3_importance` (default) | (pi_theta / pi_old) (r - log r - 1) | pi_old: every actor minibatch |
| `k3` | r - log r - 1 | pi_theta only: an iteration's first minibatch |

Why the weight (DeepSeek-V3.2 report, 3.1 "Unbiased KL Estimate"): the responses are sampled
once per iteration from pi_old, and after the first actor update pi_theta != pi_old. For any
token distribution, E_{x~pi_old}[(pi_theta / pi_old) f(x)] = sum_x pi_theta(x) f(x), and with
f = r - log r - 1 that sum is sum pi_ref - sum pi_theta log(pi_ref / pi_theta) - sum pi_theta
= 1 + KL(pi_theta || pi_ref) - 1: the KL exactly. Plain k3 averages f under pi_old instead,
which is biased as soon as pi_theta has moved.

Gradients: pi_old is a constant (the recomputed pre-update log-probs), pi_ref is a constant, and
the ratio pi_theta / pi_old keeps its gradient, as V3.2 writes the estimator. Then the expected
gradient is grad sum_x pi_theta(x) f(x) = grad KL(pi_theta || pi_ref), for every pi_old. Plain k3
differentiated through pi_theta alone has expected gradient E[(1 - r) grad log pi_theta], which
even on-policy is -sum pi_ref grad log pi_theta = grad KL(pi_ref || pi_theta), the reverse
direction. The ratio is not clipped: within one epoch pi_theta stays close to pi_old.

pi_old here is the training path's recomputation of the sampling policy; its remaining gap to
pi_infer (the engine that really sampled) is the training-inference mismatch MIS-PO's filters
handle (report 5.2.1), not this estimator. Every input is [B, T]; `mask` is 1 on response
tokens. `kl_terms` gives the per-token terms, which the actor loss aggregates like its policy
term (GRPO's KL sits inside its per-sequence mean); `kl_estimate` is their mean over response
tokens (the `kl` metric).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KL_ESTIMATORS = ("k3_importance", "k3")


def _masked_mean(x, mask):
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def k3_terms(logp, ref_logp, mask):
    """Plain k3 (Schulman's estimator) per token, r - log r - 1 with r = pi_ref / pi_theta:
    >= 0, 0 off the mask; unbiased only on tokens sampled from pi_theta itself."""
    log_r = jnp.where(mask > 0, ref_logp - logp, 0.0)
    return jnp.exp(log_r) - log_r - 1.0


def k3_importance_terms(logp, old_logp, ref_logp, mask):
    """(pi_theta / pi_old) * k3 per token: unbiased on tokens sampled from pi_old, gradient
    through both pi_theta factors (see the module docstring)."""
    mask = mask.astype(jnp.float32)
    log_ratio = logp - jax.lax.stop_gradient(old_logp)
    ratio = jnp.exp(jnp.where(mask > 0, log_ratio, 0.0))
    return ratio * k3_terms(logp, ref_logp, mask)


def kl_terms(estimator: str, logp, old_logp, ref_logp, mask):
    """The `rl.kl_estimator` named estimator's per-token terms [B, T], 0 off the mask.
    `old_logp` is unused by `k3`."""
    if estimator == "k3_importance":
        return k3_importance_terms(logp, old_logp, ref_logp, mask)
    if estimator == "k3":
        return k3_terms(logp, ref_logp, mask)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def kl_estimate(estimator: str, logp, old_logp, ref_logp, mask):
    """The mean of `kl_terms` over the response tokens -> scalar."""
    mask = mask.astype(jnp.float32)
    return _masked_mean(kl_terms(estimator, logp, old_logp, ref_logp, mask), mask)
