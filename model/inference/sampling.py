"""Next-token distributions: temperature, top-k and top-p (nucleus) applied to logits.

Greedy decoding is temperature 0, represented as the one-hot distribution of the argmax, so sampling
and speculative acceptance (model/inference/speculative.py) need no separate greedy code path.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Sampling(NamedTuple):
    """temperature 0 = greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature: must be >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def token_probs(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """logits [..., V] -> probabilities [..., V] float32 of the sampling distribution."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    if sampling.top_p < 1:
        # Keep the smallest set of most likely tokens whose mass reaches top_p: a token stays
        # if the mass strictly before it (in descending order) is still below top_p.
        order = jnp.argsort(-probs, axis=-1)
        sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
        before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = before < sampling.top_p
        keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1,
                                  inplace=False)
        probs = jnp.where(keep, probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return probs


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per row from probabilities [..., V] -> int32 [...]."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def sample_with_logprob(key: jax.Array, probs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`sample`, plus the log-probability of each drawn token under `probs` (float32 [...])."""
    token = sample(key, probs)
    return token, jnp.log(jnp.take_along_axis(probs, token[..., None], axis=-1)[..., 0])
