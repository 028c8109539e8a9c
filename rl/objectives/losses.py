"""Actor losses for RL on sampled responses: MIS-PO (report 5.2.1, eq. 2) and its baselines.

Every input is [B, T] over the tokens of B rollouts: `logp` = log pi_theta(a_t|s_t) of the
sampled token under the policy being trained (differentiated), `old_logp` = the same under the
pre-update policy recomputed by the training path (pi_old), `infer_logp` = as recorded by the
inference path that sampled it (pi_vllm in the report), `advantages` (treated as constants) and
`mask` (1 on response tokens, 0 on prompt and padding). `select` (optional, [B, T]) removes
further tokens from the gradient, e.g. all but the high-entropy ones; like every filter here it
leaves the denominator unchanged. Each loss returns (scalar loss, stats dict of scalars).

| loss | per-token term | used by |
|---|---|---|
| `mis_po_loss` (eq. 2) | I(x_t) I(rho(tau)) * -logp * A | mis_po |
| `ppo_clip_loss` | -min(r A, clip(r, 1-eps_low, 1+eps_high) A), r = pi/pi_old | ppo, grpo, dapo, dr_grpo |
| `gspo_loss` (App. D, eq. 16) | MIS masks * -min(r_tau A, clip(r_tau, 1-eps, 1+eps) A) | gspo |
| `kimi_k25_loss` (K2.5 eq. 1) | -Clip(r, alpha, beta) A + tau (log r)^2, r = pi/pi_infer | kimi_k25 |
| `mopd_loss` (MiMo MOPD, eqs. 7-8) | -w_t A logp, w_t = sg[pi/pi_infer] inside [eps_low, eps_high], else 0 | mopd |

The baselines' objectives, as their papers write them (o_i: response i of a group of G, r_it
its token ratio, A_i its advantage; rl/config.py sets each algorithm's switches):
- GRPO (DeepSeekMath, eqs. 3-4): J = (1/G) sum_i (1/|o_i|) sum_t { min(r_it A_i, clip(r_it,
  1-eps, 1+eps) A_i) - beta D_it }, D_it = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1 (k3),
  A_i = (R_i - mean R) / std R, eps = 0.2, beta = 0.04: `ppo_clip_loss` with `sequence_mean`
  plus beta times the `k3` terms (rl.objectives.kl) aggregated the same way.
- DAPO (its eq. 8): J = (1 / sum_i |o_i|) sum_i sum_t min(r_it A_i, clip(r_it, 1-eps_low,
  1+eps_high) A_i), eps_low = 0.2, eps_high = 0.28, no KL: `ppo_clip_loss` with `token_mean`.
- Dr. GRPO: J = (1/G) sum_i sum_t min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i) / L_max with
  A_i = R_i - mean R (no std, no 1/|o_i|), no KL: `ppo_clip_loss` with `token_sum`.
Every loss is -J.

Every loss sums its per-token terms and divides them by the `aggregation`'s denominator
(`rl.loss_aggregation`; n_i = response i's tokens, G = responses, L_max = `max_length`):

| aggregation | loss | used by |
|---|---|---|
| `token_mean` (default) | sum_i sum_t term / sum_i n_i | report eq. 2; DAPO 3.3 (token-level) |
| `sequence_mean` | (1/G) sum_i (1/n_i) sum_t term | GRPO (DeepSeekMath) |
| `token_sum` | sum_i sum_t term / (L_max G) | Dr. GRPO (Liu et al. 2025) |

`token_sum` divides by a constant: every token weighs the same whatever its response's length
(no per-response 1/n_i, the length bias Dr. GRPO removes) and whatever the batch's token count
(which `token_mean`'s denominator follows). G counts the rows with a response token, so the
masked padding rows of a short minibatch (`rl.update.minibatches`) change nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TOKEN_BOUNDS = (0.5, 2.0)  # report 5.2.3: rho_min, rho_max of the token-level filter
TRAJ_BOUNDS = (0.996, 1.001)  # ... of the trajectory-level (geometric mean) filter
AGGREGATIONS = ("token_mean", "sequence_mean", "token_sum")
# Kimi K2.5 eq. 1's alpha, beta and tau: the source gives none, these are ours (`kimi_k25_loss`).
KIMI_BOUNDS = (0.5, 2.0)
KIMI_TAU = 0.1


def masked_mean(x, weights):
    """sum(x * weights) / sum(weights), 0 when the weights are all 0."""
    return jnp.sum(x * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def aggregate(terms, mask, aggregation: str = "token_mean", max_length: int | None = None):
    """Per-token loss terms [B, T] (0 where a filter dropped them) -> scalar, divided by the
    `aggregation`'s denominator over the response tokens `mask` [B, T] (module docstring).
    `max_length` (L_max) is needed by `token_sum` only."""
    tokens_per_row = jnp.sum(mask, axis=1)
    responses = jnp.maximum(jnp.sum(tokens_per_row > 0), 1)
    if aggregation == "token_mean":
        return jnp.sum(terms) / jnp.maximum(jnp.sum(tokens_per_row), 1.0)
    if aggregation == "sequence_mean":
        return jnp.sum(jnp.sum(terms, axis=1) / jnp.maximum(tokens_per_row, 1.0)) / responses
    if aggregation == "token_sum":
        if max_length is None:
            raise ValueError("token_sum aggregation needs max_length (L_max)")
        return jnp.sum(terms) / (max_length * responses)
    raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


def mis_filters(old_logp, infer_logp, mask, token_bounds=TOKEN_BOUNDS, traj_bounds=TRAJ_BOUNDS):
    """The two binary masks of eq. 2 -> (token keep [B, T], trajectory keep [B], stats).

    x_t = pi_old / pi_infer per token; the trajectory ratio is the geometric mean of x_t over
    its response tokens, exp(mean log x_t). Both are kept iff inside their closed bounds."""
    mask = mask.astype(jnp.float32)
    log_x = jnp.where(mask > 0, old_logp - infer_logp, 0.0)
    x = jnp.exp(log_x)
    token_keep = (x >= token_bounds[0]) & (x <= token_bounds[1])
    tokens_per_row = jnp.sum(mask, axis=1)
    traj_ratio = jnp.exp(jnp.sum(log_x, axis=1) / jnp.maximum(tokens_per_row, 1.0))
    traj_keep = (traj_ratio >= traj_bounds[0]) & (traj_ratio <= traj_bounds[1])
    rows = (tokens_per_row > 0).astype(jnp.float32)
    keep = token_keep & traj_keep[:, None]
    stats = {
        "token_keep_frac": masked_mean(keep.astype(jnp.float32), mask),
        "token_filter_frac": masked_mean(token_keep.astype(jnp.float32), mask),
        "traj_keep_frac": masked_mean(traj_keep.astype(jnp.float32), rows),
        "mismatch/log_ratio_mean": masked_mean(log_x, mask),
        "mismatch/abs_log_ratio_mean": masked_mean(jnp.abs(log_x), mask),
        "mismatch/traj_ratio_mean": masked_mean(traj_ratio, rows),
    }
    return keep, traj_keep, stats


def mis_po_loss(logp, old_logp, infer_logp, advantages, mask, token_bounds=TOKEN_BOUNDS,
                traj_bounds=TRAJ_BOUNDS, select=None, aggregation="token_mean", max_length=None):
    """Eq. 2: sum(keep * mask * -logp * A) / sum(mask) (the default `token_mean`); kept samples
    count as on-policy (no importance weight), filtered ones contribute nothing but stay in the
    denominator."""
    mask = mask.astype(jnp.float32)
    keep, _, stats = mis_filters(old_logp, infer_logp, mask, token_bounds, traj_bounds)
    weights = keep * mask * _select(select, mask)
    advantages = jax.lax.stop_gradient(advantages)
    loss = aggregate(weights * -logp * advantages, mask, aggregation, max_length)
    return loss, stats


def ppo_clip_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2, select=None,
                  aggregation="token_mean", max_length=None):
    """PPO's clipped surrogate with token ratios r = pi_theta / pi_old, aggregated over
    response tokens. `clip_high` > `clip_low` is DAPO's clip-higher."""
    mask = mask.astype(jnp.float32)
    advantages = jax.lax.stop_gradient(advantages)
    ratio = jnp.exp(jnp.where(mask > 0, logp - jax.lax.stop_gradient(old_logp), 0.0))
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    surrogate = jnp.minimum(ratio * advantages, clipped * advantages)
    weights = mask * _select(select, mask)
    loss = aggregate(-weights * surrogate, mask, aggregation, max_length)
    clipped_away = (ratio * advantages != surrogate).astype(jnp.float32)
    return loss, {"clip_frac": masked_mean(clipped_away, mask),
                  "ratio_mean": masked_mean(jax.lax.stop_gradient(ratio), mask)}


def group_advantages(rewards, group_size: int, eps: float = 1e-6, scale: bool = True):
    """GRPO: each reward minus its group's mean, divided by the group's std if `scale`.
    Dr. GRPO drops the division (`scale=False`, `rl.group_std=false`), which gives the prompts
    whose rewards barely vary (nearly all right or all wrong) the largest weights. rewards [B]
    with B = prompts * group_size, the samples of a prompt adjacent -> [B]."""
    groups = rewards.reshape(-1, group_size)
    centred = groups - jnp.mean(groups, axis=1, keepdims=True)
    if scale:
        centred = centred / (jnp.std(groups, axis=1, keepdims=True) + eps)
    return centred.reshape(rewards.shape)


def gspo_loss(logp, old_logp, infer_logp, advantages, mask, clip=1e-4,
              token_bounds=TOKEN_BOUNDS, traj_bounds=TRAJ_BOUNDS, select=None,
              aggregation="token_mean", max_length=None):
    """Report App. D, eqs. 14-16: the sequence ratio r_tau = (prod pi_theta / pi_old)^(1/T)
    (geometric mean over the response) replaces the token ratio in PPO's clipped surrogate,
    under the same MIS token and trajectory masks; clip eps = 1e-4 as in the report."""
    mask = mask.astype(jnp.float32)
    keep, _, stats = mis_filters(old_logp, infer_logp, mask, token_bounds, traj_bounds)
    advantages = jax.lax.stop_gradient(advantages)
    log_r = jnp.where(mask > 0, logp - jax.lax.stop_gradient(old_logp), 0.0)
    seq_ratio = jnp.exp(jnp.sum(log_r, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0))
    ratio = seq_ratio[:, None]
    clipped = jnp.clip(ratio, 1.0 - clip, 1.0 + clip)
    surrogate = jnp.minimum(ratio * advantages, clipped * advantages)
    weights = keep * mask * _select(select, mask)
    loss = aggregate(-weights * surrogate, mask, aggregation, max_length)
    clipped_away = (ratio * advantages != surrogate).astype(jnp.float32)
    return loss, {**stats, "clip_frac": masked_mean(clipped_away, mask)}


def kimi_k25_loss(logp, infer_logp, advantages, mask, bounds=KIMI_BOUNDS, tau=KIMI_TAU,
                  select=None, aggregation="token_mean", max_length=None):
    """Kimi K2.5's policy objective (its 4.5, eq. 1), negated:

        L = -(1/N) sum_j sum_i [ Clip(r_ji, alpha, beta) (R_j - mean_K R) - tau (log r_ji)^2 ]

    with N the tokens generated (`token_mean`) and `advantages` = R_j - mean_K R (group
    advantages without the std). Clip acts as a gradient mask, independent of the advantage's
    sign (unlike PPO's min): inside the closed [alpha, beta] (`bounds`) a token's policy gradient
    is r A grad log pi, outside it is zero (the term keeps the clipped value). The penalty acts on
    every token, inside the bounds or not, so a token the mask froze is still pulled back.

    r = pi_theta / pi_old where pi_old is the policy that sampled the responses, as the
    inference path recorded it (`infer_logp`): the report adds the mask against the off-policy
    drift that the training-inference mismatch amplifies, which a ratio to the training path's
    recomputation would not see (it is exactly 1 on an iteration's first minibatch).
    `alpha, beta, tau > 0` are hyperparameters the source leaves open; the defaults are ours:
    [0.5, 2] are the bounds of MIS-PO's token filter (report 5.2.3), the same kind of
    train-inference ratio mask; tau = 0.1 makes the penalty's pull 2 tau |log r| at those bounds
    (0.14) a fraction of the push of a typical advantage (|R - mean R| = 0.5 for a group half
    right), so inside the mask the policy gradient leads and the penalty is a soft trust region.
    `select` (e.g. the high-entropy mask) removes tokens from the policy-gradient term only: the
    penalty, like a KL term, stays on every token."""
    mask = mask.astype(jnp.float32)
    log_ratio = jnp.where(mask > 0, logp - jax.lax.stop_gradient(infer_logp), 0.0)
    ratio = jnp.exp(log_ratio)
    inside = (ratio >= bounds[0]) & (ratio <= bounds[1])
    clipped = jnp.where(inside, ratio, jax.lax.stop_gradient(jnp.clip(ratio, *bounds)))
    advantages = jax.lax.stop_gradient(advantages)
    terms = -clipped * advantages * _select(select, mask) + tau * log_ratio ** 2
    loss = aggregate(terms * mask, mask, aggregation, max_length)
    return loss, {"ratio_kept_frac": masked_mean(inside.astype(jnp.float32), mask),
                  "log_ratio_sq_mean": masked_mean(jax.lax.stop_gradient(log_ratio) ** 2, mask)}


def mopd_loss(logp, infer_logp, advantages, mask, ratio_bounds, select=None,
              aggregation="sequence_mean", max_length=None):
    """MiMo-V2-Flash's MOPD surrogate (eqs. 7-8): per token -w_t * A_t * logp, with the
    truncated importance weight w_t = sg[pi_theta / mu_theta] when eps_low <= pi_theta /
    mu_theta <= eps_high (closed bounds, `ratio_bounds`) and 0 otherwise. pi_theta is the
    policy being trained (`logp`, the training path), mu_theta the inference path that sampled
    (`infer_logp`): w_t corrects the train-inference mismatch and drops the tokens where it is
    large. Eq. 7 averages 1/|y| within a response, then over responses: `sequence_mean`."""
    mask = mask.astype(jnp.float32)
    ratio = jax.lax.stop_gradient(jnp.exp(jnp.where(mask > 0, logp - infer_logp, 0.0)))
    keep = (ratio >= ratio_bounds[0]) & (ratio <= ratio_bounds[1])
    weights = jnp.where(keep, ratio, 0.0) * mask * _select(select, mask)
    advantages = jax.lax.stop_gradient(advantages)
    loss = aggregate(weights * -logp * advantages, mask, aggregation, max_length)
    return loss, {"w_kept_frac": masked_mean(keep.astype(jnp.float32), mask),
                  "w_mean": masked_mean(jnp.where(keep, ratio, 0.0), mask)}


def high_entropy_mask(entropy, mask, top_frac: float):
    """1 on the top `top_frac` of response tokens of the batch by entropy (the "forking tokens"
    of seed 003, rho = 0.2 there), 0 elsewhere: the k-th largest entropy with k = ceil(top_frac
    * N) is the threshold, ties included. entropy, mask: [B, T] -> float32 [B, T]."""
    mask = mask > 0
    count = jnp.sum(mask)
    # (1 - 1e-6): top_frac * count is rounded up in float32 (0.3 * 100 -> 30.000002), which
    # must not add a token.
    k = jnp.clip(jnp.ceil(top_frac * count * (1 - 1e-6)), 1, None).astype(jnp.int32)
    ranked = jnp.sort(jnp.where(mask, entropy, -jnp.inf).reshape(-1))[::-1]
    threshold = ranked[k - 1]
    return (mask & (entropy >= threshold)).astype(jnp.float32)


def _select(select, mask):
    return jnp.ones_like(mask) if select is None else select.astype(jnp.float32)
