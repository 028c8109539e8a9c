"""RL actor losses (rl/objectives/losses.py) and advantage estimation (rl/objectives/advantages.py).

Tested against hand-derived literals (derivations in comments) or explicit float64 python/numpy
loop references written here, never against the code under test:

- `mis_po_loss` / `mis_filters`: token filter (closed bounds, dropped tokens stay in the
  denominator), trajectory filter (geometric mean over masked tokens), keep fractions, exact
  zero gradients for masked / filtered tokens and w.r.t. advantages, the on-policy gradient,
  `select`;
- `ppo_clip_loss` / `grpo_loss`: clipped surrogate for both advantage signs, clip_frac, zero
  gradient through the clipped branch, DAPO clip-higher, token-level normalisation;
- `group_advantages`, `gspo_loss`, `kl_penalty` (incl. a Monte-Carlo unbiasedness check),
  `high_entropy_mask`;
- `gae`, `bootstrapped_rewards`, `terminal_rewards`.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.objectives import advantages as A
from rl.objectives import losses as L

# Jitted once per module (one compile per shape instead of one per eager op: ~5x faster on CPU).
_BOUNDS = ("token_bounds", "traj_bounds")
mis_filters = jax.jit(L.mis_filters, static_argnames=_BOUNDS)
mis_po_loss = jax.jit(L.mis_po_loss, static_argnames=_BOUNDS)
ppo_clip_loss = jax.jit(L.ppo_clip_loss, static_argnames=("clip_low", "clip_high"))
grpo_loss = jax.jit(L.grpo_loss, static_argnames=("clip_low", "clip_high"))
gspo_loss = jax.jit(L.gspo_loss, static_argnames=("clip", *_BOUNDS))
kl_penalty = jax.jit(L.kl_penalty)
group_advantages = jax.jit(L.group_advantages, static_argnames=("group_size", "eps", "scale"))
high_entropy_mask = jax.jit(L.high_entropy_mask, static_argnames=("top_frac",))
gae = jax.jit(A.gae)  # gamma, lam traced: one compile for every (gamma, lam)
bootstrapped_rewards = jax.jit(A.bootstrapped_rewards)
terminal_rewards = jax.jit(A.terminal_rewards)


def _loss_only(fn):
    return lambda *args, **kwargs: fn(*args, **kwargs)[0]


# d loss / d (logp, old_logp, infer_logp, advantages) and d loss / d (logp, old_logp, advantages)
mis_po_grads = jax.jit(jax.grad(_loss_only(L.mis_po_loss), argnums=(0, 1, 2, 3)),
                       static_argnames=_BOUNDS)
ppo_clip_grads = jax.jit(jax.grad(_loss_only(L.ppo_clip_loss), argnums=(0, 1, 2)))
grpo_grads = jax.jit(jax.grad(_loss_only(L.grpo_loss), argnums=(0, 1, 2)))

LN2 = math.log(2.0)


def f32(x):
    return jnp.asarray(np.asarray(x, np.float64), jnp.float32)


# --------------------------------------------------------------------------------------------
# A float64 reference of eq. 2, written independently as explicit loops.

def reference_mis_po(logp, old_logp, infer_logp, advantages, mask, token_bounds=(0.5, 2.0),
                     traj_bounds=(0.996, 1.001), select=None):
    logp, old, infer, adv, mask = (np.asarray(a, np.float64)
                                   for a in (logp, old_logp, infer_logp, advantages, mask))
    select = np.ones_like(mask) if select is None else np.asarray(select, np.float64)
    B, T = mask.shape
    numerator, denominator = 0.0, 0.0
    for b in range(B):
        log_x = [old[b, t] - infer[b, t] for t in range(T) if mask[b, t] > 0]
        traj_ok = (not log_x) or (traj_bounds[0] <= math.exp(sum(log_x) / len(log_x))
                                  <= traj_bounds[1])
        for t in range(T):
            if mask[b, t] == 0:
                continue
            denominator += 1.0
            x = math.exp(old[b, t] - infer[b, t])
            if traj_ok and token_bounds[0] <= x <= token_bounds[1]:
                numerator += select[b, t] * -logp[b, t] * adv[b, t]
    return numerator / max(denominator, 1.0)


# Shared [2, 5] batch: row 0 has 5 response tokens, row 1 has 3 (then 2 padding positions).
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.float64)
LOGP = -np.array([[0.1, 0.2, 0.3, 0.4, 0.5], [0.6, 0.7, 0.8, 0.9, 1.0]])
ADV = np.array([[1.0] * 5, [-0.5] * 5])


def test_mis_po_drops_out_of_bounds_token_but_keeps_it_in_denominator():
    # Row 0: token 0 has x = 2.5 > 2 (dropped); tokens 1..4 have log x = -ln(2.5)/4 each
    # (x = 0.795, kept), so the row's geometric mean is exp(0) = 1 (trajectory kept).
    # Row 1: old == infer (x = 1). Padding positions carry a huge ratio that must be ignored.
    log_x = np.array([[math.log(2.5)] + [-math.log(2.5) / 4] * 4, [0, 0, 0, 5.0, 5.0]])
    infer = np.full((2, 5), -1.0)
    old = infer + log_x
    loss, stats = mis_po_loss(f32(LOGP), f32(old), f32(infer), f32(ADV), f32(MASK))
    # kept: row 0 tokens 1..4: -logp*A = 0.2+0.3+0.4+0.5 = 1.4; row 1 tokens 0..2:
    # (0.6+0.7+0.8) * -0.5 = -1.05; sum 0.35 over all 8 response tokens -> 0.04375.
    np.testing.assert_allclose(loss, 0.04375, rtol=1e-6)
    np.testing.assert_allclose(loss, reference_mis_po(LOGP, old, infer, ADV, MASK), rtol=1e-6)
    np.testing.assert_allclose(stats["token_keep_frac"], 7 / 8, rtol=1e-6)
    np.testing.assert_allclose(stats["token_filter_frac"], 7 / 8, rtol=1e-6)
    np.testing.assert_allclose(stats["traj_keep_frac"], 1.0, rtol=1e-6)


@pytest.mark.parametrize("row_log_ratio", [0.01, -0.01])
def test_mis_po_drops_whole_trajectory_outside_geometric_mean_bounds(row_log_ratio):
    # Row 1: every token x = exp(+-0.01) (inside [0.5, 2]) but the geometric mean 1.01 > 1.001
    # (resp. 0.990 < 0.996): the whole row contributes nothing. Row 0 is on-policy.
    infer = np.full((2, 5), -1.0)
    old = infer + np.array([[0.0] * 5, [row_log_ratio] * 3 + [0.0, 0.0]])
    loss, stats = mis_po_loss(f32(LOGP), f32(old), f32(infer), f32(ADV), f32(MASK))
    # Only row 0: (0.1+0.2+0.3+0.4+0.5) * 1 = 1.5, over 8 tokens -> 0.1875.
    np.testing.assert_allclose(loss, 0.1875, rtol=1e-6)
    np.testing.assert_allclose(loss, reference_mis_po(LOGP, old, infer, ADV, MASK), rtol=1e-6)
    np.testing.assert_allclose(stats["traj_keep_frac"], 1 / 2, rtol=1e-6)  # 1 of 2 rows
    np.testing.assert_allclose(stats["token_keep_frac"], 5 / 8, rtol=1e-6)  # row 0's tokens
    np.testing.assert_allclose(stats["token_filter_frac"], 1.0, rtol=1e-6)  # no token filtered


def test_mis_po_trajectory_ratio_ignores_padding_positions():
    # Padding of row 1 has log x = 0.5 (x = 1.65, inside the token bounds): if it entered the
    # geometric mean, the row would be dropped. The response tokens have x = 1 -> row kept.
    infer = np.full((2, 5), -1.0)
    old = infer + np.array([[0.0] * 5, [0.0, 0.0, 0.0, 0.5, 0.5]])
    loss, stats = mis_po_loss(f32(LOGP), f32(old), f32(infer), f32(ADV), f32(MASK))
    # (1.5 - 1.05) / 8 = 0.05625
    np.testing.assert_allclose(loss, 0.05625, rtol=1e-6)
    np.testing.assert_allclose(stats["traj_keep_frac"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(stats["token_keep_frac"], 1.0, rtol=1e-6)


def test_mis_po_matches_float64_loop_reference_on_mixed_batch():
    rng = np.random.default_rng(0)
    logp = -rng.uniform(0.1, 3.0, (2, 5))
    infer = -rng.uniform(0.1, 3.0, (2, 5))
    # Row 0: one token far off (x = e), small noise elsewhere; row 1: near on-policy.
    old = infer + np.array([[1.0, 1e-4, -2e-4, 1e-4, 0.0], [1e-4, -1e-4, 2e-4, 3.0, -3.0]])
    adv = rng.normal(size=(2, 5))
    select = np.array([[1, 1, 0, 1, 1], [1, 0, 1, 1, 1]], np.float64)
    for kwargs in ({}, {"select": select}, {"traj_bounds": (0.5, 2.0)}):
        loss, _ = mis_po_loss(f32(logp), f32(old), f32(infer), f32(adv), f32(MASK),
                              **{k: f32(v) if k == "select" else v for k, v in kwargs.items()})
        expected = reference_mis_po(logp, old, infer, adv, MASK, **kwargs)
        np.testing.assert_allclose(loss, expected, rtol=1e-5)


def _mis_po_grad(logp, old, infer, adv, mask, argnums=0):
    grads = mis_po_grads(f32(logp), f32(old), f32(infer), f32(adv), f32(mask))
    return grads[argnums]


def test_mis_po_gradient_is_exactly_zero_on_masked_and_filtered_tokens():
    # Row 0 token 0 is token-filtered (x = 2.5); row 1 padding positions are masked.
    log_x = np.array([[math.log(2.5)] + [-math.log(2.5) / 4] * 4, [0, 0, 0, 0, 0]])
    infer = np.full((2, 5), -1.0)
    grad = np.asarray(_mis_po_grad(LOGP, infer + log_x, infer, ADV, MASK))
    assert grad[0, 0] == 0.0  # filtered
    assert grad[1, 3] == 0.0 and grad[1, 4] == 0.0  # masked out
    assert np.all(grad[0, 1:] != 0.0) and np.all(grad[1, :3] != 0.0)  # the rest do learn
    # A filtered trajectory: every one of its tokens gets exactly zero gradient.
    old = infer + np.array([[0.0] * 5, [0.01] * 5])
    grad = np.asarray(_mis_po_grad(LOGP, old, infer, ADV, MASK))
    assert np.all(grad[1] == 0.0)
    assert np.all(grad[0] != 0.0)


def test_mis_po_on_policy_gradient_is_exact_policy_gradient():
    # old == infer: every x = 1, nothing filtered; d loss / d logp_t = -A_t * mask_t / sum(mask).
    # sum(mask) = 8 is a power of two, so the float32 division is exact and so is the check.
    adv = np.array([[1.0, -2.0, 0.5, 3.0, -0.25], [-0.5, 1.5, 2.0, 7.0, 9.0]])
    infer = np.full((2, 5), -1.0)
    grad = _mis_po_grad(LOGP, infer, infer, adv, MASK)
    expected = (-adv * MASK / 8.0).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(grad), expected)


def test_mis_po_advantages_get_no_gradient():
    infer = np.full((2, 5), -1.0)
    grad = np.asarray(_mis_po_grad(LOGP, infer, infer, ADV, MASK, argnums=3))
    assert np.all(grad == 0.0)


def test_mis_po_select_removes_numerator_terms_only():
    infer = np.full((2, 5), -1.0)
    select = np.array([[0, 1, 1, 0, 1], [1, 0, 1, 1, 1]], np.float64)
    loss, _ = mis_po_loss(f32(LOGP), f32(infer), f32(infer), f32(ADV), f32(MASK),
                          select=f32(select))
    # row 0 tokens 1, 2, 4: 0.2+0.3+0.5 = 1.0; row 1 tokens 0, 2: (0.6+0.8) * -0.5 = -0.7;
    # sum 0.3, still over all 8 response tokens -> 0.0375.
    np.testing.assert_allclose(loss, 0.0375, rtol=1e-6)


def test_mis_filters_bounds_are_inclusive():
    # Row 0 token ratios exactly 2.0 and 0.5 (float32 exp(+-ln 2) is exactly 2 / 0.5 here) and
    # 2.25 / 0.4 just outside. Each row is a single token so its geometric mean is its ratio:
    # with trajectory bounds (0.5, 2.0) those rows at exactly 2.0 / 0.5 are kept too.
    old = np.array([[LN2, -LN2, math.log(2.25), math.log(0.4), 0.0]])
    infer = np.zeros((1, 5))
    mask = np.ones((1, 5))
    assert float(jnp.exp(f32(LN2))) == 2.0 and float(jnp.exp(f32(-LN2))) == 0.5
    keep, _, _ = mis_filters(f32(old), f32(infer), f32(mask), traj_bounds=(0.0, 10.0))
    np.testing.assert_array_equal(np.asarray(keep), [[True, True, False, False, True]])

    old_rows = np.array([[LN2, 0.0], [-LN2, 0.0], [math.log(2.25), 0.0]])
    mask_rows = np.array([[1, 0], [1, 0], [1, 0]], np.float64)
    keep, traj_keep, stats = mis_filters(f32(old_rows), f32(np.zeros((3, 2))), f32(mask_rows),
                                         traj_bounds=(0.5, 2.0))
    np.testing.assert_array_equal(np.asarray(traj_keep), [True, True, False])
    np.testing.assert_allclose(stats["traj_keep_frac"], 2 / 3, rtol=1e-6)


# --------------------------------------------------------------------------------------------
# PPO-clip and GRPO (DAPO)

# Row 0: five tokens covering both advantage signs inside / outside the clip range (0.2, 0.2).
# Row 1: three on-policy tokens with A = 2 and two padding positions with a wild ratio.
PPO_RATIO = np.array([[1.1, 1.5, 1.5, 0.5, 0.5], [1.0, 1.0, 1.0, 5.0, 0.1]])
PPO_ADV = np.array([[1.0, 1.0, -1.0, -1.0, 1.0], [2.0] * 5])


def test_ppo_clip_loss_hand_computed():
    old = np.full((2, 5), -1.0)
    logp = old + np.log(PPO_RATIO)
    loss, stats = ppo_clip_loss(f32(logp), f32(old), f32(PPO_ADV), f32(MASK))
    # row 0: r=1.1,A=+1 -> min(1.1, 1.1) = 1.1 (inside);  r=1.5,A=+1 -> min(1.5, 1.2) = 1.2
    # (clipped); r=1.5,A=-1 -> min(-1.5, -1.2) = -1.5 (unclipped); r=0.5,A=-1 -> min(-0.5,
    # -0.8) = -0.8 (clipped); r=0.5,A=+1 -> min(0.5, 0.8) = 0.5 (unclipped). Sum 0.5.
    # row 1: 3 * 2 = 6. loss = -(0.5 + 6) / 8 = -0.8125; clipped 2 of 8 tokens.
    np.testing.assert_allclose(loss, -0.8125, rtol=1e-6)
    np.testing.assert_allclose(stats["clip_frac"], 0.25, rtol=1e-6)
    # ratio_mean over the 8 response tokens: (1.1+1.5+1.5+0.5+0.5+3) / 8 = 8.1 / 8
    np.testing.assert_allclose(stats["ratio_mean"], 8.1 / 8, rtol=1e-6)


def test_ppo_clip_gradient_zero_through_active_clipped_branch():
    old = np.full((2, 5), -1.0)
    logp = old + np.log(PPO_RATIO)

    g_logp, g_old, g_adv = ppo_clip_grads(f32(logp), f32(old), f32(PPO_ADV), f32(MASK))
    g_logp = np.asarray(g_logp)
    assert g_logp[0, 1] == 0.0 and g_logp[0, 3] == 0.0  # clipped branch active
    assert g_logp[1, 3] == 0.0 and g_logp[1, 4] == 0.0  # padding
    # unclipped tokens: d/dlogp of -r*A/8 = -r*A/8 (dr/dlogp = r)
    expected = {(0, 0): -1.1 / 8, (0, 2): 1.5 / 8, (0, 4): -0.5 / 8, (1, 0): -2 / 8,
                (1, 1): -2 / 8, (1, 2): -2 / 8}
    for (b, t), value in expected.items():
        np.testing.assert_allclose(g_logp[b, t], value, rtol=1e-6)
    assert np.all(np.asarray(g_old) == 0.0) and np.all(np.asarray(g_adv) == 0.0)


def test_grpo_clip_higher_keeps_ratio_1_25_and_clips_1_3():
    # Positive advantage: upper clip at 1 + 0.28 = 1.28.
    old = np.zeros((1, 2)) - 1.0
    logp = old + np.log([[1.25, 1.3]])
    mask = np.ones((1, 2))
    adv = np.ones((1, 2))
    loss, stats = grpo_loss(f32(logp), f32(old), f32(adv), f32(mask))
    # 1.25 unclipped, 1.3 -> 1.28: loss = -(1.25 + 1.28) / 2 = -1.265; 1 of 2 clipped.
    np.testing.assert_allclose(loss, -1.265, rtol=1e-6)
    np.testing.assert_allclose(stats["clip_frac"], 0.5, rtol=1e-6)
    grad = np.asarray(grpo_grads(f32(logp), f32(old), f32(adv), f32(mask))[0])
    np.testing.assert_allclose(grad[0, 0], -1.25 / 2, rtol=1e-6)
    assert grad[0, 1] == 0.0
    # The same 1.25 with the symmetric PPO range (0.2, 0.2) is clipped to 1.2.
    loss_ppo, _ = ppo_clip_loss(f32(logp), f32(old), f32(adv), f32(mask))
    np.testing.assert_allclose(loss_ppo, -(1.2 + 1.2) / 2, rtol=1e-6)


def test_grpo_token_level_normalisation_weighs_every_token_equally():
    # Responses of lengths 1 (A = +1) and 3 (A = -1), on-policy (r = 1).
    mask = np.array([[1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], np.float64)
    adv = np.array([[1.0] * 5, [-1.0] * 5])
    logp = np.full((2, 5), -0.7)
    loss, _ = grpo_loss(f32(logp), f32(logp), f32(adv), f32(mask))
    # token level: -(1*1 + 3*(-1)) / 4 = 0.5 (a per-sequence mean would give -(1 - 1)/2 = 0)
    np.testing.assert_allclose(loss, 0.5, rtol=1e-6)
    grad = grpo_grads(f32(logp), f32(logp), f32(adv), f32(mask))[0]
    # every response token gets -A / 4 whatever its response's length (exact: 4 = 2^2, r = 1)
    expected = (-adv * mask / 4.0).astype(np.float32)
    assert np.all(np.asarray(grad) == expected)


# --------------------------------------------------------------------------------------------
# group advantages

def test_group_advantages_hand_computed():
    rewards = f32([1, 0, 0, 0, 1, 1, 1, 1])
    adv = group_advantages(rewards, 4)
    # group 1: mean 0.25, population std sqrt(0.25 * 0.75) = sqrt(3)/4
    std = math.sqrt(3) / 4
    expected = [0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3 + [0.0] * 4
    np.testing.assert_allclose(adv, expected, rtol=1e-6)
    assert np.all(np.asarray(adv)[4:] == 0.0)  # identical rewards -> exactly 0


def test_group_advantages_groups_of_two_and_unscaled():
    rewards = f32([0.0, 1.0, 3.0, 1.0])
    # groups (0, 1): mean 0.5, std 0.5; (3, 1): mean 2, std 1
    np.testing.assert_allclose(group_advantages(rewards, 2),
                               [-0.5 / 0.500001, 0.5 / 0.500001, 1 / 1.000001, -1 / 1.000001],
                               rtol=1e-6)
    np.testing.assert_allclose(group_advantages(rewards, 2, scale=False), [-0.5, 0.5, 1, -1],
                               rtol=1e-6)
    np.testing.assert_allclose(group_advantages(rewards, 4, scale=False),
                               [-1.25, -0.25, 1.75, -0.25], rtol=1e-6)


# --------------------------------------------------------------------------------------------
# GSPO

GSPO_MASK = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], np.float64)
# row 0: token log-ratios average to 5e-5 (inside eps = 1e-4); row 1: average 3e-4 (outside).
# Padding positions carry large log-ratios that must not enter the sequence mean.
GSPO_LOG_R = np.array([[2e-4, -1e-4, 0.0, 1e-4, 0.5], [4e-4, 2e-4, 0.3, -0.3, 1.0]])


def _gspo_inputs():
    old = np.zeros((2, 5))  # logp - old is then exactly logp (no float32 cancellation)
    return GSPO_LOG_R, old, old  # logp, old_logp, infer_logp (old == infer: MIS keeps all)


def test_gspo_sequence_ratio_inside_and_outside_clip():
    logp, old, infer = _gspo_inputs()
    adv = np.array([[1.0] * 5, [2.0] * 5])
    loss, stats = gspo_loss(f32(logp), f32(old), f32(infer), f32(adv), f32(GSPO_MASK))
    # row 0: r = exp(5e-5) inside [0.9999, 1.0001]: 4 tokens * r * 1
    # row 1: r = exp(3e-4) = 1.0003 > 1.0001, A = +2 -> 2 * 1.0001 = 2.0002 on each of 2 tokens
    expected = -(4 * math.exp(5e-5) + 2 * 2.0002) / 6
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(stats["clip_frac"], 2 / 6, rtol=1e-6)

    # Negative advantage on row 1: min(-2 * 1.0003, -2 * 1.0001) is the unclipped -2*exp(3e-4);
    # row 0 (A = 0.5) is unchanged: 4 * 0.5 * exp(5e-5).
    adv_neg = np.array([[0.5] * 5, [-2.0] * 5])
    loss, stats = gspo_loss(f32(logp), f32(old), f32(infer), f32(adv_neg), f32(GSPO_MASK))
    expected = -(4 * 0.5 * math.exp(5e-5) - 2 * 2 * math.exp(3e-4)) / 6
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(stats["clip_frac"], 0.0, atol=0)


def test_gspo_applies_mis_token_and_trajectory_masks():
    logp, old, _ = _gspo_inputs()
    adv = np.array([[1.0] * 5, [2.0] * 5])
    # row 0: token 1 has pi_old / pi_infer = 3 (token-filtered), tokens 0, 2, 3 compensate
    # (log -ln3/3 each, x = 0.69) so its geometric mean is 1; row 1: x = exp(0.01) on both
    # tokens -> geometric mean 1.01 > 1.001, the whole row is dropped.
    log_x = np.array([[-math.log(3) / 3, math.log(3), -math.log(3) / 3, -math.log(3) / 3, 0.0],
                      [0.01, 0.01, 0.0, 0.0, 0.0]])
    infer = old - log_x
    loss, stats = gspo_loss(f32(logp), f32(old), f32(infer), f32(adv), f32(GSPO_MASK))
    # only row 0 tokens 0, 2, 3 survive: 3 * exp(5e-5) * 1, still over 6 tokens
    np.testing.assert_allclose(loss, -3 * math.exp(5e-5) / 6, rtol=1e-6)
    np.testing.assert_allclose(stats["token_keep_frac"], 3 / 6, rtol=1e-6)
    np.testing.assert_allclose(stats["traj_keep_frac"], 1 / 2, rtol=1e-6)


# --------------------------------------------------------------------------------------------
# KL penalty

def test_kl_penalty_hand_computed_and_masked():
    logp = np.full((2, 5), -1.0)
    # token ratios r = pi_ref / pi = 2 and 0.5, two tokens with r = 1, padding with r = e^3
    ref = logp + np.array([[LN2, -LN2, 0.0, 0.0, 3.0], [0.0] * 5])
    mask = np.array([[1, 1, 1, 1, 0], [0] * 5], np.float64)
    # (2 - ln2 - 1) + (0.5 + ln2 - 1) + 0 + 0 = 0.5 over 4 tokens -> 0.125
    np.testing.assert_allclose(kl_penalty(f32(logp), f32(ref), f32(mask)), 0.125, rtol=1e-6)


def test_kl_penalty_zero_when_equal_and_nonnegative():
    rng = np.random.default_rng(1)
    logp = -rng.uniform(0.1, 4.0, (2, 5))
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.float64)
    assert float(kl_penalty(f32(logp), f32(logp), f32(mask))) == 0.0
    for _ in range(5):
        ref = -rng.uniform(0.1, 4.0, (2, 5))
        assert float(kl_penalty(f32(logp), f32(ref), f32(mask))) >= 0.0
        # per-token k3 terms are each >= 0: single-token masks
        for b, t in [(0, 0), (1, 4)]:
            one = np.zeros((2, 5))
            one[b, t] = 1.0
            assert float(kl_penalty(f32(logp), f32(ref), f32(one))) >= 0.0


def test_kl_penalty_is_unbiased_monte_carlo():
    p = np.array([0.5, 0.25, 0.15, 0.1])
    q = np.array([0.3, 0.3, 0.2, 0.2])
    exact = float(np.sum(p * np.log(p / q)))  # KL(p || q)
    rng = np.random.default_rng(2)
    tokens = rng.choice(4, size=200_000, p=p).reshape(400, 500)
    logp, ref = np.log(p)[tokens], np.log(q)[tokens]
    estimate = float(kl_penalty(f32(logp), f32(ref), jnp.ones((400, 500), jnp.float32)))
    assert abs(estimate - exact) < 1e-2, (estimate, exact)


# --------------------------------------------------------------------------------------------
# high-entropy token selection

ENTROPY = np.array([[0.1, 0.9, 0.3, 0.5, 0.2], [0.8, 0.4, 0.6, 9.0, 10.0]])


def test_high_entropy_mask_keeps_top_fraction_of_masked_tokens():
    # 8 response tokens; padding (row 1, t = 3, 4) has the highest entropies but is ignored.
    # top 0.25 -> ceil(2) = 2 tokens: 0.9 and 0.8.
    got = high_entropy_mask(f32(ENTROPY), f32(MASK), 0.25)
    np.testing.assert_array_equal(np.asarray(got), [[0, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    assert got.dtype == jnp.float32
    # top 0.3 -> ceil(2.4) = 3 tokens: 0.9, 0.8, 0.6
    got = high_entropy_mask(f32(ENTROPY), f32(MASK), 0.3)
    np.testing.assert_array_equal(np.asarray(got), [[0, 1, 0, 0, 0], [1, 0, 1, 0, 0]])
    # top 0.5 -> 4 tokens: 0.9, 0.8, 0.6, 0.5
    got = high_entropy_mask(f32(ENTROPY), f32(MASK), 0.5)
    np.testing.assert_array_equal(np.asarray(got), [[0, 1, 0, 1, 0], [1, 0, 1, 0, 0]])


# --------------------------------------------------------------------------------------------
# advantages: GAE, bootstrapping, terminal rewards

def reference_gae(token_rewards, values, mask, gamma, lam):
    """Explicit float64 loop: delta_t = r_t + gamma V_{t+1} - V_t (V after the last response
    token = 0), A_t = delta_t + gamma lam A_{t+1}; zero off the mask."""
    r, v, m = (np.asarray(a, np.float64) for a in (token_rewards, values, mask))
    adv = np.zeros_like(r)
    for b in range(r.shape[0]):
        positions = [t for t in range(r.shape[1]) if m[b, t] > 0]
        running = 0.0
        for i in reversed(range(len(positions))):
            t = positions[i]
            v_next = v[b, positions[i + 1]] if i + 1 < len(positions) else 0.0
            delta = r[b, t] + gamma * v_next - v[b, t]
            running = delta + gamma * lam * running
            adv[b, t] = running
    return adv, (adv + v) * m


GAE_MASK = np.array([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], np.float64)  # prompt / response / pad
GAE_VALUES = np.array([[7.0, 0.5, 0.25, 1.0, -3.0], [4.0, -2.0, 0.3, 0.6, 0.9]])


def test_gae_gamma_lambda_one_is_reward_to_go_minus_value():
    rewards = np.array([1.0, -0.5])
    token_rewards = np.array([[0, 0, 0, 1.0, 0], [0, 0, 0, 0, -0.5]])
    adv, ret = gae(f32(token_rewards), f32(GAE_VALUES), f32(GAE_MASK))
    # terminal reward R: A_t = R - V_t on each response token, returns = R there
    expected = np.where(GAE_MASK > 0, rewards[:, None] - GAE_VALUES, 0.0)
    np.testing.assert_allclose(adv, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ret, rewards[:, None] * GAE_MASK, rtol=1e-6, atol=1e-7)
    ref_adv, ref_ret = reference_gae(token_rewards, GAE_VALUES, GAE_MASK, 1.0, 1.0)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(adv)[GAE_MASK == 0] == 0.0)
    assert np.all(np.asarray(ret)[GAE_MASK == 0] == 0.0)


def test_gae_discounted_hand_computed():
    # Row 0, response values V = (0.5, 0.25, 1.0), reward 1 on the last token, gamma=lam=0.5:
    # delta_3 = 1 + 0 - 1.0 = 0;  delta_2 = 0.5*1.0 - 0.25 = 0.25;  delta_1 = 0.5*0.25 - 0.5
    # = -0.375.  A_3 = 0;  A_2 = 0.25 + 0.25*0 = 0.25;  A_1 = -0.375 + 0.25*0.25 = -0.3125.
    # returns = A + V = (0.1875, 0.5, 1.0).
    token_rewards = np.array([[0, 0, 0, 1.0, 0], [0, 0, 0, 0.2, -0.5]])
    adv, ret = gae(f32(token_rewards), f32(GAE_VALUES), f32(GAE_MASK), gamma=0.5, lam=0.5)
    np.testing.assert_allclose(np.asarray(adv)[0], [0, -0.3125, 0.25, 0.0, 0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ret)[0], [0, 0.1875, 0.5, 1.0, 0], rtol=1e-6)
    ref_adv, ref_ret = reference_gae(token_rewards, GAE_VALUES, GAE_MASK, 0.5, 0.5)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(adv)[GAE_MASK == 0] == 0.0)
    # other (gamma, lam) pairs against the loop reference
    for gamma, lam in [(0.9, 0.95), (1.0, 0.5), (0.5, 1.0)]:
        adv, ret = gae(f32(token_rewards), f32(GAE_VALUES), f32(GAE_MASK), gamma, lam)
        ref_adv, ref_ret = reference_gae(token_rewards, GAE_VALUES, GAE_MASK, gamma, lam)
        np.testing.assert_allclose(adv, ref_adv, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(ret, ref_ret, rtol=1e-6, atol=1e-6)


def test_bootstrapped_rewards_replaces_only_truncated_rows():
    rewards = f32([1.0, 0.0, 1.0, 0.0])
    truncated = jnp.array([False, True, True, False])
    final_values = f32([0.3, 0.7, -0.2, 0.9])
    np.testing.assert_allclose(bootstrapped_rewards(rewards, truncated, final_values),
                               [1.0, 0.7, -0.2, 0.0], rtol=1e-6)


def test_terminal_rewards_on_last_masked_position():
    mask = np.array([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]], np.float64)
    got = terminal_rewards(f32([2.0, -1.0, 5.0]), f32(mask))
    np.testing.assert_array_equal(np.asarray(got), [[0, 0, 0, 2.0, 0], [0, 0, 0, 0, -1.0],
                                                     [0, 0, 0, 0, 0]])
