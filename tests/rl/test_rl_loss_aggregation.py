"""Loss aggregation (`rl.loss_aggregation`: token_mean, sequence_mean, Dr. GRPO's token_sum) of
every actor loss in rl/objectives/losses.py, and Dr. GRPO's unnormalised group advantages,
against explicit float64 loops over rows and tokens written here and hand-computed values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.objectives import losses as L

_STATIC = ("aggregation", "max_length")
ppo_clip_loss = jax.jit(L.ppo_clip_loss, static_argnames=("clip_low", "clip_high", *_STATIC))
mis_po_loss = jax.jit(L.mis_po_loss, static_argnames=_STATIC)
gspo_loss = jax.jit(L.gspo_loss, static_argnames=("clip", *_STATIC))
group_advantages = jax.jit(L.group_advantages, static_argnames=("group_size", "scale"))

L_MAX = 7
# Responses of 5, 2, 7 and 1 tokens after a prompt, and one padding row (a minibatch's top-up).
LENGTHS = [5, 2, 7, 1, 0]
B, T = len(LENGTHS), 9


def f32(x):
    return jnp.asarray(np.asarray(x, np.float64), jnp.float32)


def random_inputs(seed):
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T))
    for b, n in enumerate(LENGTHS):
        mask[b, 1:1 + n] = 1.0
    old = -rng.uniform(0.2, 3.0, (B, T))
    logp = old + rng.normal(scale=0.3, size=(B, T))
    infer = old - rng.normal(scale=0.3, size=(B, T))
    adv = np.repeat(rng.normal(size=(B, 1)), T, axis=1)
    return logp, old, infer, adv, mask


def reference_aggregate(terms, mask, aggregation):
    """Float64 loops: the per-token terms summed, divided as the aggregation says."""
    rows = [[terms[b][t] for t in range(T) if mask[b][t] > 0] for b in range(B)]
    responses = [row for row in rows if row]
    if aggregation == "token_mean":
        return sum(sum(row) for row in responses) / sum(len(row) for row in responses)
    if aggregation == "sequence_mean":
        return sum(sum(row) / len(row) for row in responses) / len(responses)
    return sum(sum(row) for row in responses) / (L_MAX * len(responses))


def reference_ppo_terms(logp, old, adv, clip_low, clip_high):
    terms = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            r = math.exp(logp[b, t] - old[b, t])
            clipped = min(max(r, 1 - clip_low), 1 + clip_high)
            terms[b, t] = -min(r * adv[b, t], clipped * adv[b, t])
    return terms


def reference_mis_keep(old, infer, mask):
    """Eq. 2's masks by loops: token ratio in [0.5, 2], row geometric mean in [0.996, 1.001]."""
    keep = np.zeros((B, T))
    for b in range(B):
        logs = [old[b, t] - infer[b, t] for t in range(T) if mask[b, t] > 0]
        traj = math.exp(sum(logs) / max(len(logs), 1))
        for t in range(T):
            x = math.exp(old[b, t] - infer[b, t])
            keep[b, t] = float(0.5 <= x <= 2.0 and 0.996 <= traj <= 1.001)
    return keep


AGGREGATIONS = ["token_mean", "sequence_mean", "token_sum"]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_ppo_clip_loss_aggregations_match_loop_reference(aggregation):
    for seed in range(3):
        logp, old, _, adv, mask = random_inputs(seed)
        loss, _ = ppo_clip_loss(f32(logp), f32(old), f32(adv), f32(mask), clip_low=0.2,
                                clip_high=0.28, aggregation=aggregation, max_length=L_MAX)
        terms = reference_ppo_terms(logp, old, adv, 0.2, 0.28)
        np.testing.assert_allclose(loss, reference_aggregate(terms, mask, aggregation),
                                   rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_mis_po_loss_aggregations_match_loop_reference(aggregation):
    for seed in range(3):
        logp, old, infer, adv, mask = random_inputs(seed)
        # rows 0-3 on-policy (infer = old) but one token of row 0 over the token bound, which
        # also puts row 0's geometric mean (3^(1/5)) out of bounds: row 0 is dropped whole
        infer[:4] = old[:4]
        infer[0, 3] = old[0, 3] - math.log(3)
        loss, _ = mis_po_loss(f32(logp), f32(old), f32(infer), f32(adv), f32(mask),
                              aggregation=aggregation, max_length=L_MAX)
        keep = reference_mis_keep(old, infer, mask)
        assert keep[1:4].sum() == 3 * T and keep[0].sum() == 0
        terms = keep * -logp * adv
        np.testing.assert_allclose(loss, reference_aggregate(terms, mask, aggregation),
                                   rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gspo_loss_aggregations_match_loop_reference(aggregation):
    for seed in range(3):
        logp, old, _, adv, mask = random_inputs(seed)
        logp = old + np.random.default_rng(seed).normal(scale=2e-4, size=(B, T))
        loss, _ = gspo_loss(f32(logp - old), f32(np.zeros((B, T))), f32(np.zeros((B, T))),
                            f32(adv), f32(mask), aggregation=aggregation, max_length=L_MAX)
        terms = np.zeros((B, T))
        for b in range(B):
            logs = [logp[b, t] - old[b, t] for t in range(T) if mask[b, t] > 0]
            r = math.exp(sum(logs) / max(len(logs), 1))
            clipped = min(max(r, 1 - 1e-4), 1 + 1e-4)
            terms[b] = -min(r * adv[b, 0], clipped * adv[b, 0])
        np.testing.assert_allclose(loss, reference_aggregate(terms, mask, aggregation),
                                   rtol=2e-5, atol=1e-6)


def test_token_sum_gives_every_token_the_same_gradient_whatever_its_length():
    """Dr. GRPO on-policy (ratio 1): d loss / d logp = -A / (L_max * G) on every response token,
    short or long response alike; sequence_mean gives -A / (n_i * G), token_mean -A / sum n_i."""
    _, _, _, _, mask = random_inputs(0)
    logp = np.full((B, T), -1.0)
    adv = np.ones((B, T))
    responses, tokens = 4, sum(LENGTHS)
    expected = {"token_sum": lambda n: -1 / (L_MAX * responses),
                "sequence_mean": lambda n: -1 / (n * responses),
                "token_mean": lambda n: -1 / tokens}
    for aggregation, per_token in expected.items():
        grad = jax.grad(lambda lp: L.ppo_clip_loss(lp, f32(logp), f32(adv), f32(mask),
                                                   aggregation=aggregation,
                                                   max_length=L_MAX)[0])(f32(logp))
        for b, n in enumerate(LENGTHS):
            want = np.where(mask[b] > 0, per_token(n) if n else 0.0, 0.0)
            np.testing.assert_allclose(np.asarray(grad)[b], want, rtol=1e-6, atol=1e-9)


def test_token_sum_without_max_length_and_unknown_aggregation_are_refused():
    args = (f32(np.zeros((1, 2))), f32(np.zeros((1, 2))), f32(np.ones((1, 2))),
            f32(np.ones((1, 2))))
    with pytest.raises(ValueError, match="token_sum aggregation needs max_length"):
        L.ppo_clip_loss(*args, aggregation="token_sum")
    with pytest.raises(ValueError, match="unknown aggregation 'sum'"):
        L.ppo_clip_loss(*args, aggregation="sum")


def test_dr_grpo_group_advantages_are_reward_minus_group_mean():
    rng = np.random.default_rng(4)
    for group_size in (2, 4, 8):
        rewards = rng.integers(0, 3, size=5 * group_size).astype(np.float64) / 2
        expected = np.zeros_like(rewards)
        for g in range(5):
            group = rewards[g * group_size:(g + 1) * group_size]
            mean = sum(group) / group_size
            for i in range(group_size):
                expected[g * group_size + i] = group[i] - mean
        got = group_advantages(f32(rewards), group_size=group_size, scale=False)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
