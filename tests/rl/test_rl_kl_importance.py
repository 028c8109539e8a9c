"""The KL estimators of rl/objectives/kl.py off-policy: tokens drawn from pi_old != pi_theta, as
in every actor minibatch after an iteration's first. The references are exact sums over a small
vocabulary in float64 numpy, and the Monte-Carlo tolerances come from the per-sample standard
deviations of those same float64 formulas (never from the code under test)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.objectives import kl as K

PI_THETA = np.array([0.5, 0.25, 0.15, 0.1])  # the policy being trained
PI_OLD = np.array([0.15, 0.2, 0.3, 0.35])  # the policy that sampled the tokens
PI_REF = np.array([0.3, 0.3, 0.2, 0.2])
SHAPE = (200, 500)  # 100k tokens


def exact_kl(p, q):
    return float(np.sum(p * np.log(p / q)))


def exact_kl_grad(p, q):
    """d KL(softmax(theta) || q) / d theta = p * (log(p / q) - KL), by hand."""
    return p * (np.log(p / q) - exact_kl(p, q))


def k3_terms(p, q):
    """r - log r - 1 per vocabulary entry, r = q / p."""
    r = q / p
    return r - np.log(r) - 1.0


def sample_tokens(seed):
    rng = np.random.default_rng(seed)
    return rng.choice(len(PI_OLD), size=SHAPE, p=PI_OLD)


def f32(x):
    return jnp.asarray(np.asarray(x, np.float64), jnp.float32)


def estimate(estimator, theta_logits, tokens):
    """The estimator on the sampled tokens, pi_theta = softmax(theta_logits) [V] (float32)."""
    logp = jax.nn.log_softmax(theta_logits)[tokens]
    return K.kl_estimate(estimator, logp, f32(np.log(PI_OLD))[tokens],
                         f32(np.log(PI_REF))[tokens], jnp.ones(SHAPE, jnp.float32))


def test_importance_weighted_k3_is_unbiased_off_policy_and_plain_k3_is_not():
    tokens = sample_tokens(0)
    theta = f32(np.log(PI_THETA))
    exact = exact_kl(PI_THETA, PI_REF)
    per_token = (PI_THETA / PI_OLD) * k3_terms(PI_THETA, PI_REF)  # float64, per vocab entry
    stderr = np.sqrt(np.sum(PI_OLD * per_token ** 2) - exact ** 2) / np.sqrt(tokens.size)
    corrected = float(jax.jit(estimate, static_argnums=0)("k3_importance", theta, tokens))
    assert abs(corrected - exact) < 5 * stderr, (corrected, exact, stderr)

    plain = float(jax.jit(estimate, static_argnums=0)("k3", theta, tokens))
    terms = k3_terms(PI_THETA, PI_REF)
    plain_mean = float(np.sum(PI_OLD * terms))  # what plain k3 estimates: E_old, not E_theta
    plain_stderr = np.sqrt(np.sum(PI_OLD * terms ** 2) - plain_mean ** 2) / np.sqrt(tokens.size)
    assert abs(plain_mean - exact) > 0.04  # 0.141 against 0.097
    assert abs(plain - plain_mean) < 5 * plain_stderr, (plain, plain_mean)
    assert abs(plain - exact) > 50 * plain_stderr, (plain, exact)


def test_expected_gradient_of_importance_weighted_k3_is_the_kl_gradient():
    """With the ratio pi_theta / pi_old differentiated, the mean gradient over tokens from pi_old
    is grad KL(pi_theta || pi_ref); plain k3 misses it by far."""
    tokens = sample_tokens(1)
    theta = f32(np.log(PI_THETA))
    exact = exact_kl_grad(PI_THETA, PI_REF)
    # per-sample gradient of w * f, w = p/s: w * (-log r) * (e_x - p), by hand in float64
    log_r = np.log(PI_REF / PI_THETA)
    per_sample = ((PI_THETA / PI_OLD) * -log_r)[:, None] * (np.eye(4) - PI_THETA)
    stderr = np.sqrt(PI_OLD @ per_sample ** 2 - (PI_OLD @ per_sample) ** 2) / np.sqrt(tokens.size)
    grad = jax.jit(jax.grad(estimate, argnums=1), static_argnums=0)
    corrected = np.asarray(grad("k3_importance", theta, tokens), np.float64)
    np.testing.assert_array_less(np.abs(corrected - exact), 5 * stderr + 1e-6)
    plain = np.asarray(grad("k3", theta, tokens), np.float64)
    assert np.abs(plain - exact).max() > 0.2, (plain, exact)


@pytest.mark.parametrize("estimator", ["k3_importance", "k3"])
def test_on_policy_both_estimate_the_kl_but_only_the_weighted_one_has_its_gradient(estimator):
    """pi_old = pi_theta, exact expectation: the k3 terms weighted by pi_theta over the whole
    vocabulary (the mask as weights). Both values are the KL; the gradients differ: plain k3's
    is the gradient of the reverse KL(pi_ref || pi_theta) (rl/objectives/kl.py)."""
    vocab = np.arange(4)[None, :]

    def expectation(theta_logits):
        logp = jax.nn.log_softmax(theta_logits)[vocab]
        old = jax.lax.stop_gradient(logp)
        return K.kl_estimate(estimator, logp, old, f32(np.log(PI_REF)[vocab]), f32([PI_THETA]))

    theta = jnp.asarray(np.log(PI_THETA), jnp.float32)
    value, grad = jax.value_and_grad(expectation)(theta)
    np.testing.assert_allclose(float(value), exact_kl(PI_THETA, PI_REF), rtol=1e-5)
    # reverse-KL gradient by hand: d/dtheta sum q log(q / p) = p - q
    expected = exact_kl_grad(PI_THETA, PI_REF) if estimator == "k3_importance" else (
        PI_THETA - PI_REF)
    np.testing.assert_allclose(np.asarray(grad), expected, atol=1e-6)
    # the two gradients differ by 0.02 here, 10^4 times the tolerance
    assert np.abs(exact_kl_grad(PI_THETA, PI_REF) - (PI_THETA - PI_REF)).max() > 0.02


def test_importance_weight_hand_computed_and_masked():
    # one token with pi_theta / pi_old = 2 and r = pi_ref / pi_theta = 0.5, one with ratio 1 and
    # r = 2, one masked token with a huge ratio: (2 (0.5 + ln 2 - 1) + (2 - ln 2 - 1)) / 2
    ln2 = np.log(2.0)
    logp = np.array([[-1.0, -1.0, -1.0]])
    old = logp - np.array([[ln2, 0.0, -5.0]])
    ref = logp + np.array([[-ln2, ln2, 3.0]])
    mask = np.array([[1.0, 1.0, 0.0]])
    expected = (2 * (0.5 + ln2 - 1) + (2 - ln2 - 1)) / 2
    def estimate(mask):
        return float(K.kl_estimate("k3_importance", f32(logp), f32(old), f32(ref), f32(mask)))

    np.testing.assert_allclose(estimate(mask), expected, rtol=1e-6)
    assert estimate(mask * 0) == 0.0


def test_unknown_estimator_is_named():
    with pytest.raises(ValueError, match="unknown KL estimator 'k2'"):
        K.kl_estimate("k2", f32([[0.0]]), f32([[0.0]]), f32([[0.0]]), f32([[1.0]]))
