"""Plain k3 KL (rl/objectives/kl.py), high-entropy token selection (rl/objectives/losses.py)
and advantage estimation (rl/objectives/advantages.py) against hand-derived literals and explicit
float64 loop references written here, never against the code under test: `k3` (incl. a
Monte-Carlo unbiasedness check on tokens from pi_theta itself; off-policy and the importance-
weighted estimator: test_rl_kl_importance.py), `high_entropy_mask`, `gae`,
`bootstrapped_rewards`, `terminal_rewards`.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from rl.objectives import advantages as A
from rl.objectives import kl as K
from rl.objectives import losses as L

# Jitted once per module (one compile per shape instead of one per eager op: ~5x faster on CPU).
k3 = jax.jit(lambda logp, ref, mask: K.kl_estimate("k3", logp, logp, ref, mask))
high_entropy_mask = jax.jit(L.high_entropy_mask, static_argnames=("top_frac",))
gae = jax.jit(A.gae)  # gamma, lam traced: one compile for every (gamma, lam)
bootstrapped_rewards = jax.jit(A.bootstrapped_rewards)
terminal_rewards = jax.jit(A.terminal_rewards)

LN2 = math.log(2.0)

MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.float64)  # row 1: two padding positions


def f32(x):
    return jnp.asarray(np.asarray(x, np.float64), jnp.float32)


# --------------------------------------------------------------------------------------------
# KL penalty (plain k3)

def test_k3_hand_computed_and_masked():
    logp = np.full((2, 5), -1.0)
    # token ratios r = pi_ref / pi = 2 and 0.5, two tokens with r = 1, padding with r = e^3
    ref = logp + np.array([[LN2, -LN2, 0.0, 0.0, 3.0], [0.0] * 5])
    mask = np.array([[1, 1, 1, 1, 0], [0] * 5], np.float64)
    # (2 - ln2 - 1) + (0.5 + ln2 - 1) + 0 + 0 = 0.5 over 4 tokens -> 0.125
    np.testing.assert_allclose(k3(f32(logp), f32(ref), f32(mask)), 0.125, rtol=1e-6)


def test_k3_zero_when_equal_and_nonnegative():
    rng = np.random.default_rng(1)
    logp = -rng.uniform(0.1, 4.0, (2, 5))
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.float64)
    assert float(k3(f32(logp), f32(logp), f32(mask))) == 0.0
    for _ in range(5):
        ref = -rng.uniform(0.1, 4.0, (2, 5))
        assert float(k3(f32(logp), f32(ref), f32(mask))) >= 0.0
        # per-token k3 terms are each >= 0: single-token masks
        for b, t in [(0, 0), (1, 4)]:
            one = np.zeros((2, 5))
            one[b, t] = 1.0
            assert float(k3(f32(logp), f32(ref), f32(one))) >= 0.0


def test_k3_is_unbiased_monte_carlo_on_policy():
    p = np.array([0.5, 0.25, 0.15, 0.1])
    q = np.array([0.3, 0.3, 0.2, 0.2])
    exact = float(np.sum(p * np.log(p / q)))  # KL(p || q)
    rng = np.random.default_rng(2)
    tokens = rng.choice(4, size=200_000, p=p).reshape(400, 500)
    logp, ref = np.log(p)[tokens], np.log(q)[tokens]
    estimate = float(k3(f32(logp), f32(ref), jnp.ones((400, 500), jnp.float32)))
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
