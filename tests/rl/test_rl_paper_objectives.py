"""Each baseline's default objective is its paper's: `rl.algorithm=grpo | dapo | dr_grpo |
kimi_k25` with every switch at its preset, from verifier rewards through the group advantages
to `actor_loss`, against float64 loops written here from the papers' equations (value and
gradient with respect to log pi_theta, derived by hand), never from the code under test:

- GRPO (DeepSeekMath eqs. 3-4): J = (1/G) sum_i (1/|o_i|) sum_t {min(r A, clip(r, 0.8, 1.2) A)
  - 0.04 (pi_ref/pi - log(pi_ref/pi) - 1)}, A_i = (R_i - mean R) / std R;
- DAPO (its eq. 8): J = (1 / sum_i |o_i|) sum_i sum_t min(r A, clip(r, 0.8, 1.28) A), no KL;
- Dr. GRPO: J = (1/G) sum_i sum_t min(r A, clip(r, 0.8, 1.2) A) / L_max, A_i = R_i - mean R,
  no KL;
- Kimi K2.5 (eq. 1): J = (1/N) sum_j sum_i [Clip(r, 0.5, 2) (R_j - mean R) - 0.1 (log r)^2],
  r = pi_theta / pi_infer, the clip a gradient mask (N: the tokens generated), no KL.
The loss is -J. r = pi_theta / pi_old for the clipped surrogates (pi_old: the training path's
recomputation), and the reference's log-probs differ from both. Kimi K2.5's mask, penalty and
`select` are also checked by hand on three tokens.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.config import RLConfig
from rl.objectives import losses
from rl.update import actor_loss

GROUP, L_MAX = 4, 5
# Two groups of four responses; position 0 is the prompt, response lengths 5, 2, 3, 1, 4, 5, 2, 3.
LENGTHS = [5, 2, 3, 1, 4, 5, 2, 3]
MASK = np.array([[0.0] + [1.0] * n + [0.0] * (L_MAX - n) for n in LENGTHS])
REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
_rng = np.random.default_rng(7)
OLD = -np.abs(_rng.normal(1.0, 0.5, MASK.shape))  # log pi_old
# log(pi_theta / pi_old): spread over [-0.9, 0.9], so that tokens fall on both sides of every
# clip range and of Kimi's mask [0.5, 2] (log 2 = 0.69); none lies on a boundary.
LOGP = OLD + _rng.uniform(-0.9, 0.9, MASK.shape)
INFER = OLD + _rng.normal(0.0, 0.3, MASK.shape)  # log pi_infer: the sampler's record
REF = OLD + _rng.normal(0.0, 0.4, MASK.shape)  # log pi_ref: the initial policy


def paper_advantages(rewards, scale_by_std):
    """Per response: R_i - mean of its group, over the group's (population) std if asked."""
    out = np.zeros(len(rewards))
    for start in range(0, len(rewards), GROUP):
        group = rewards[start:start + GROUP]
        mean = sum(group) / GROUP
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / GROUP)
        for i, r in enumerate(group):
            out[start + i] = (r - mean) / (std + 1e-6) if scale_by_std else r - mean
    return out


def clipped_surrogate(log_r, adv, low, high):
    """min(r A, clip(r, 1-low, 1+high) A) and its derivative in log pi_theta."""
    ratio = math.exp(log_r)
    clipped = min(max(ratio, 1 - low), 1 + high)
    if ratio * adv <= clipped * adv:
        return ratio * adv, ratio * adv
    return clipped * adv, 0.0


def paper_objective(algorithm):
    """(loss, d loss / d log pi_theta [B, T]) by the paper's equation, one token at a time."""
    scale = algorithm in ("grpo", "dapo")
    adv = paper_advantages(REWARDS, scale)
    token_terms = {}  # (b, t) -> (objective term, its derivative)
    for b, n in enumerate(LENGTHS):
        for t in range(1, n + 1):
            if algorithm == "kimi_k25":
                log_r = LOGP[b, t] - INFER[b, t]
                ratio = math.exp(log_r)
                inside = 0.5 <= ratio <= 2.0
                value = min(max(ratio, 0.5), 2.0) * adv[b] - 0.1 * log_r ** 2
                token_terms[b, t] = (value, ratio * adv[b] * inside - 0.2 * log_r)
                continue
            high = 0.28 if algorithm == "dapo" else 0.2
            value, grad = clipped_surrogate(LOGP[b, t] - OLD[b, t], adv[b], 0.2, high)
            if algorithm == "grpo":  # - beta * k3(pi_ref / pi_theta)
                log_q = REF[b, t] - LOGP[b, t]
                value -= 0.04 * (math.exp(log_q) - log_q - 1)
                grad -= 0.04 * (1 - math.exp(log_q))
            token_terms[b, t] = (value, grad)
    responses, tokens = len(LENGTHS), sum(LENGTHS)
    weight = {  # each token's weight in J, as the paper normalises
        "grpo": lambda b: 1 / (responses * LENGTHS[b]),
        "dapo": lambda b: 1 / tokens,
        "dr_grpo": lambda b: 1 / (responses * L_MAX),
        "kimi_k25": lambda b: 1 / tokens,
    }[algorithm]
    loss, grad = 0.0, np.zeros(MASK.shape)
    for (b, t), (value, d) in token_terms.items():
        loss -= weight(b) * value
        grad[b, t] = -weight(b) * d
    return loss, grad


def f32(x):
    return jnp.asarray(np.asarray(x, np.float64), jnp.float32)


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo", "kimi_k25"])
def test_default_objective_is_the_papers(algorithm):
    rl = RLConfig(algorithm=algorithm, samples_per_prompt=GROUP, max_new_tokens=L_MAX)
    advantages = losses.group_advantages(f32(REWARDS), GROUP, scale=rl.divides_by_group_std)
    mb = {"mask": f32(MASK), "select": f32(MASK), "old_logp": f32(OLD), "infer_logp": f32(INFER),
          "ref_logp": f32(REF), "advantages": advantages[:, None] * f32(MASK)}
    loss, grad = jax.jit(jax.value_and_grad(lambda lp: actor_loss(rl, lp, mb)[0]))(f32(LOGP))
    want_loss, want_grad = paper_objective(algorithm)
    assert float(loss) == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
    # the data reach every branch: clipped and unclipped tokens (Kimi: masked and kept ones)
    log_r = (LOGP - (INFER if algorithm == "kimi_k25" else OLD))[MASK > 0]
    bounds = {"kimi_k25": (0.5, 2.0), "dapo": (0.8, 1.28)}.get(algorithm, (0.8, 1.2))
    outside = (np.exp(log_r) < bounds[0]) | (np.exp(log_r) > bounds[1])
    assert 3 <= outside.sum() <= len(log_r) - 3


def test_kimi_k25_mask_penalty_and_select_by_hand():
    """Ratios 0.4, 1.5, 2.5 to pi_infer with A = 1, tau = 0.1: only 1.5 is inside [0.5, 2] and
    gets the policy gradient r A; the penalty's -2 tau log r reaches all three. `select`
    removes a token from the policy-gradient term only."""
    ratio = np.array([[0.4, 1.5, 2.5]])
    infer = np.full((1, 3), -1.0)
    logp, adv, mask = infer + np.log(ratio), np.ones((1, 3)), np.ones((1, 3))
    log_r = np.log(ratio)[0]

    def loss_and_grad(select):
        fn = lambda lp: losses.kimi_k25_loss(lp, f32(infer), f32(adv), f32(mask),  # noqa: E731
                                             select=f32(select))
        (loss, stats), grad = jax.value_and_grad(fn, has_aux=True)(f32(logp))
        return float(loss), np.asarray(grad)[0], stats

    loss, grad, stats = loss_and_grad(mask)
    # Clip keeps its value outside the bounds: 0.5 and 2.0
    assert loss == pytest.approx(-(0.5 + 1.5 + 2.0 - 0.1 * (log_r ** 2).sum()) / 3, rel=1e-6)
    np.testing.assert_allclose(grad, -(np.array([0, 1.5, 0]) - 0.2 * log_r) / 3, rtol=1e-5)
    assert float(stats["ratio_kept_frac"]) == pytest.approx(1 / 3)
    assert float(stats["log_ratio_sq_mean"]) == pytest.approx((log_r ** 2).mean(), rel=1e-5)
    loss, grad, _ = loss_and_grad(np.array([[1.0, 0.0, 1.0]]))
    assert loss == pytest.approx(-(0.5 + 2.0 - 0.1 * (log_r ** 2).sum()) / 3, rel=1e-6)
    np.testing.assert_allclose(grad, 0.2 * log_r / 3, rtol=1e-5)
