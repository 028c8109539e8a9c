"""`model.inference.scoring.Scorer` against the plain forward pass (`CausalLM.apply`, no cache):
per-token log-probabilities (log-softmax in float64 of the forward's float32 logits) and
argmax flags, for rows of different lengths in one padded batch, over several prefill chunks,
with continuations that are the forward's own greedy choice (flags True) after random
prompts (flags mostly False)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small_lm import VOCAB, small_cfg

from model.inference.decode import Decoder
from model.inference.scoring import Scorer
from model.lm import CausalLM, init_variables

LENGTH = 24


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def model():
    config = small_cfg("mtp.num_heads=0", "num_layers=2", "layout=FS", "num_dense_layers=2",
                       "swiglu_limits=[0, 0]", "swiglu_limits_shared=[0, 0]")  # no MoE: faster
    variables = nn.meta.unbox(init_variables(CausalLM(config), jax.random.key(3)))
    forward = jax.jit(lambda v, t: CausalLM(config).apply(v, t).logits)
    return config, variables, lambda tokens: np.asarray(forward(variables, jnp.asarray(
        np.pad(tokens, (0, LENGTH - len(tokens)))[None], jnp.int32)))[0, :len(tokens)]


def greedy_extension(forward, prompt: list[int], total: int) -> list[int]:
    """`prompt` continued by the forward pass's argmax up to `total` tokens."""
    tokens = list(prompt)
    while len(tokens) < total:
        tokens.append(int(np.argmax(forward(np.array(tokens))[-1])))
    return tokens


def test_scores_match_the_forward_pass_over_chunks_and_padding(model):
    config, variables, forward = model
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, VOCAB, n).tolist() for n in (LENGTH, 9, 2)]
    sequences.append(greedy_extension(forward, rng.integers(0, VOCAB, 5).tolist(), 17))
    # 4 rows in batches of 3 (the second padded with empty rows); chunks of 8 positions
    scorer = Scorer(Decoder(config, variables, max_len=LENGTH, prefill_chunk=8), batch_size=3)
    for sequence, (logprobs, greedy) in zip(sequences, scorer.score(sequences)):
        logits = forward(np.array(sequence))[:-1]
        want = np.take_along_axis(log_softmax64(logits), np.array(sequence[1:])[:, None], -1)
        np.testing.assert_allclose(logprobs, want[:, 0], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(greedy, logits.argmax(-1) == np.array(sequence[1:]))
    greedy_row = scorer.score([sequences[-1]])[0][1]
    assert greedy_row[4:].all() and not greedy_row[:4].all()


def test_a_sequence_one_longer_than_the_cache_is_scored(model):
    """n tokens put n - 1 in the cache (the last is only predicted): lm-eval's windows are
    max_length + 1 tokens (its rolling windows, contexts cut on the left), which the harness
    scores with a cache of max_length positions."""
    config, variables, forward = model
    sequence = np.random.default_rng(1).integers(0, VOCAB, LENGTH).tolist()
    scorer = Scorer(Decoder(config, variables, max_len=LENGTH - 1, prefill_chunk=8), 1)
    (logprobs, greedy), = scorer.score([sequence])
    logits = forward(np.array(sequence))[:-1]
    want = np.take_along_axis(log_softmax64(logits), np.array(sequence[1:])[:, None], -1)
    np.testing.assert_allclose(logprobs, want[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(greedy, logits.argmax(-1) == np.array(sequence[1:]))


def test_lengths_outside_the_cache_are_refused(model):
    config, variables, _ = model
    scorer = Scorer(Decoder(config, variables, max_len=8), batch_size=2)
    for bad in ([[1]], [[1, 2], list(range(10))]):
        with pytest.raises(ValueError, match=r"sequences\[\d\]: \d+ tokens; scoring needs 2 to 9 "
                                             r"\(the decoder's max_len \+ 1\)"):
            scorer.score(bad)
