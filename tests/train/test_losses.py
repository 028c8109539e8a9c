"""Chunked cross-entropy and shifted targets against explicit float64 numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.losses import Targets, chunked_cross_entropy, shifted_targets


def numpy_cross_entropy(hidden, kernel, tokens, weights):
    logits = hidden.reshape(-1, hidden.shape[-1]).astype(np.float64) @ kernel.astype(np.float64)
    total = 0.0
    for row, (t, w) in enumerate(zip(tokens.reshape(-1), weights.reshape(-1))):
        z = logits[row]
        total += w * (np.log(np.sum(np.exp(z - z.max()))) + z.max() - z[t])
    return total


@pytest.mark.parametrize("chunk", [1, 5, 16, 64, 1000])
def test_chunked_cross_entropy_matches_full_logits(chunk):
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(2, 8, 6)).astype(np.float32)
    kernel = rng.normal(size=(6, 11)).astype(np.float32)
    tokens = rng.integers(0, 11, size=(2, 8))
    weights = (rng.random((2, 8)) > 0.3).astype(np.float32)
    total, count = chunked_cross_entropy(lambda k, h: h @ k, jnp.asarray(kernel),
                                         jnp.asarray(hidden),
                                         Targets(jnp.asarray(tokens), jnp.asarray(weights)), chunk)
    np.testing.assert_allclose(total, numpy_cross_entropy(hidden, kernel, tokens, weights),
                               rtol=1e-5)
    assert count == weights.sum()


def test_chunked_cross_entropy_gradient_matches_dense():
    """The gradients formed in the forward pass (and scaled by the incoming cotangent) equal
    autodiff of the plain full-logits loss, for the head's params and the hidden states."""
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(2, 5, 4)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(4, 7)), jnp.float32)
    weights = jnp.asarray(rng.random((2, 5)) > 0.3, jnp.float32)
    targets = Targets(jnp.asarray(rng.integers(0, 7, size=(2, 5))), weights)

    def chunked(k, h):
        return 2.5 * chunked_cross_entropy(lambda p, x: x @ p["w"], {"w": k}, h, targets, 3)[0]

    def dense(k, h):
        log_probs = jax.nn.log_softmax(h @ k)
        picked = jnp.take_along_axis(log_probs, targets.tokens[..., None], -1)[..., 0]
        return -2.5 * jnp.sum(picked * weights)

    got = jax.grad(chunked, argnums=(0, 1))(kernel, hidden)
    want = jax.grad(dense, argnums=(0, 1))(kernel, hidden)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_shifted_targets_stay_inside_documents():
    tokens = np.array([[10, 11, 12, 20, 21, 0]])
    segments = np.array([[1, 1, 1, 2, 2, 0]])
    meta = np.zeros_like(tokens, bool)
    next_token = shifted_targets(tokens, segments, meta, 1, False)
    np.testing.assert_array_equal(next_token.tokens, [[11, 12, 20, 21, 0, 0]])
    np.testing.assert_array_equal(next_token.weights, [[1, 1, 0, 1, 0, 0]])
    two_ahead = shifted_targets(tokens, segments, meta, 2, False)
    np.testing.assert_array_equal(two_ahead.tokens, [[12, 20, 21, 0, 0, 0]])
    np.testing.assert_array_equal(two_ahead.weights, [[1, 0, 0, 0, 0, 0]])


def test_meta_mask_drops_metadata_targets_only_when_switched_on():
    tokens = np.arange(8)[None]
    segments = np.ones((1, 8), np.int32)
    meta = np.array([[1, 1, 1, 0, 0, 0, 0, 0]], bool)  # |M| = 3
    before = shifted_targets(tokens, segments, meta, 1, jnp.bool_(False)).weights
    after = shifted_targets(tokens, segments, meta, 1, jnp.bool_(True)).weights
    np.testing.assert_array_equal(before, [[1, 1, 1, 1, 1, 1, 1, 0]])
    # eq. 8: predictions of s_2, s_3 (metadata) leave the loss; predicting x_1 from M stays.
    np.testing.assert_array_equal(after, [[0, 0, 1, 1, 1, 1, 1, 0]])


def test_loss_mask_keeps_only_targets_that_are_masked_tokens():
    # one chat [system s, user u, assistant a a <eot>] then a plain document of two tokens
    tokens = np.array([[1, 2, 3, 4, 5, 7, 8, 0]])
    segments = np.array([[1, 1, 1, 1, 1, 2, 2, 0]])
    meta = np.zeros_like(tokens, bool)
    trained = np.array([[0, 0, 1, 1, 1, 1, 1, 0]], bool)
    got = shifted_targets(tokens, segments, meta, 1, False, trained)
    # position t predicts t + 1: trained when t + 1 is in t's document and a masked token
    np.testing.assert_array_equal(got.weights, [[0, 1, 1, 1, 0, 1, 0, 0]])
    two_ahead = shifted_targets(tokens, segments, meta, 2, False, trained)
    np.testing.assert_array_equal(two_ahead.weights, [[1, 1, 1, 0, 0, 0, 0, 0]])
    everything = shifted_targets(tokens, segments, meta, 1, False, np.ones_like(trained))
    np.testing.assert_array_equal(everything.weights,
                                  shifted_targets(tokens, segments, meta, 1, False).weights)
