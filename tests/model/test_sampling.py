"""Tests of the next-token distribution (`model.inference.sampling.token_probs`): temperature,
top-k and top-p against a float64 numpy reference, greedy as the one-hot argmax, and
temperatures at float32's extremes (finite, the top-k kept). Pure functions, no model."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from model.inference.sampling import Sampling, token_probs


def reference_probs(logits, temperature, top_k, top_p):
    """numpy float64: softmax(logits / T), then top-k, then the smallest nucleus >= top_p."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if top_k:
        z = np.where(np.isin(np.arange(len(z)), order[:top_k]), z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p or p[i] == 0:
            break
        kept.append(i)
        mass += p[i]
    out = np.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0),
                                                        (1.3, 0, 0.6), (0.9, 5, 0.8)])
def test_token_probs_match_reference(temperature, top_k, top_p):
    logits = np.random.default_rng(2).normal(size=(4, 10)).astype(np.float32) * 2
    got = np.asarray(token_probs(jnp.asarray(logits), Sampling(temperature, top_k, top_p)))
    for row, probs in zip(logits, got):
        np.testing.assert_allclose(probs, reference_probs(row, temperature, top_k, top_p),
                                   atol=1e-6)


def test_greedy_probs_are_one_hot_argmax():
    logits = np.random.default_rng(3).normal(size=(5, 7)).astype(np.float32)
    probs = np.asarray(token_probs(jnp.asarray(logits), Sampling()))
    np.testing.assert_array_equal(probs, np.eye(7)[logits.argmax(-1)])


def test_extreme_temperatures_keep_the_top_k_and_stay_finite():
    """A huge temperature samples uniformly among the top-k tokens (its limit), not among
    every token; one below float32's smallest normal number decodes greedily, one just above
    it samples the argmax alone: never NaN."""
    logits = np.random.default_rng(4).normal(size=(3, 10)).astype(np.float32) * 3
    uniform_top3 = np.zeros_like(logits)
    np.put_along_axis(uniform_top3, np.argsort(-logits, axis=-1)[:, :3], 1 / 3, axis=-1)
    for temperature in (1e30, 1e308):
        probs = np.asarray(token_probs(jnp.asarray(logits), Sampling(temperature, 3)))
        np.testing.assert_allclose(probs, uniform_top3, atol=1e-6)
    for temperature in (1e-30, 1e-45):
        probs = np.asarray(token_probs(jnp.asarray(logits), Sampling(temperature, 3, 0.9)))
        np.testing.assert_array_equal(probs, np.eye(10)[logits.argmax(-1)])
