"""Clipped policy-gradient losses and group advantages (rl/objectives/losses.py) against
hand-derived literals (derivations in comments), never against the code under test:
`ppo_clip_loss` (clipped surrogate for both advantage signs, clip_frac, zero gradient through
the clipped branch, DAPO's clip-higher, token-level normalisation),
`group_advantages` and `gspo_loss` (sequence-level ratio and clip, MIS masks).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from rl.objectives import losses as L

# Jitted once per module (one compile per shape instead of one per eager op: ~5x faster on CPU).
_BOUNDS = ("token_bounds", "traj_bounds")
ppo_clip_loss = jax.jit(L.ppo_clip_loss, static_argnames=("clip_low", "clip_high"))
gspo_loss = jax.jit(L.gspo_loss, static_argnames=("clip", *_BOUNDS))
group_advantages = jax.jit(L.group_advantages, static_argnames=("group_size", "eps", "scale"))


def _loss_only(fn):
    return lambda *args, **kwargs: fn(*args, **kwargs)[0]


# d loss / d (logp, old_logp, advantages)
ppo_clip_grads = jax.jit(jax.grad(_loss_only(L.ppo_clip_loss), argnums=(0, 1, 2)))
# ... with DAPO's clip-higher (0.2, 0.28)
dapo_grads = jax.jit(jax.grad(_loss_only(lambda *a: L.ppo_clip_loss(*a, clip_high=0.28)),
                              argnums=(0, 1, 2)))

MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.float64)  # row 1: two padding positions


def f32(x):
    return jnp.asarray(np.asarray(x, np.float64), jnp.float32)


# --------------------------------------------------------------------------------------------
# PPO-clip, DAPO's clip-higher

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


def test_dapo_clip_higher_keeps_ratio_1_25_and_clips_1_3():
    # Positive advantage: upper clip at 1 + 0.28 = 1.28.
    old = np.zeros((1, 2)) - 1.0
    logp = old + np.log([[1.25, 1.3]])
    mask = np.ones((1, 2))
    adv = np.ones((1, 2))
    loss, stats = ppo_clip_loss(f32(logp), f32(old), f32(adv), f32(mask), clip_high=0.28)
    # 1.25 unclipped, 1.3 -> 1.28: loss = -(1.25 + 1.28) / 2 = -1.265; 1 of 2 clipped.
    np.testing.assert_allclose(loss, -1.265, rtol=1e-6)
    np.testing.assert_allclose(stats["clip_frac"], 0.5, rtol=1e-6)
    grad = np.asarray(dapo_grads(f32(logp), f32(old), f32(adv), f32(mask))[0])
    np.testing.assert_allclose(grad[0, 0], -1.25 / 2, rtol=1e-6)
    assert grad[0, 1] == 0.0
    # The same 1.25 with the symmetric PPO range (0.2, 0.2) is clipped to 1.2.
    loss_ppo, _ = ppo_clip_loss(f32(logp), f32(old), f32(adv), f32(mask))
    np.testing.assert_allclose(loss_ppo, -(1.2 + 1.2) / 2, rtol=1e-6)


def test_dapo_token_level_normalisation_weighs_every_token_equally():
    # Responses of lengths 1 (A = +1) and 3 (A = -1), on-policy (r = 1).
    mask = np.array([[1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], np.float64)
    adv = np.array([[1.0] * 5, [-1.0] * 5])
    logp = np.full((2, 5), -0.7)
    loss, _ = ppo_clip_loss(f32(logp), f32(logp), f32(adv), f32(mask), clip_high=0.28)
    # token level: -(1*1 + 3*(-1)) / 4 = 0.5 (a per-sequence mean would give -(1 - 1)/2 = 0)
    np.testing.assert_allclose(loss, 0.5, rtol=1e-6)
    grad = dapo_grads(f32(logp), f32(logp), f32(adv), f32(mask))[0]
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
