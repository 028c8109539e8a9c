"""Next-token distributions: temperature, top-k and top-p (nucleus) applied to logits.

Greedy decoding is temperature 0, represented as the one-hot distribution of the argmax, so sampling
and speculative acceptance (model/inference/speculative.py) need no separate greedy code path.
The distribution is computed in float32: top-k is chosen on the logits themselves (the same tokens
as after the temperature, without the ties a large temperature rounds them into), and the logits
are shifted by their maximum before they are divided by the temperature, so no finite
temperature overflows them (a huge one samples uniformly among the kept tokens, its limit). A
temperature below float32's smallest normal number (`GREEDY_BELOW`, 1.2e-38), which float32
cannot divide by, decodes greedily, as sampling at it would to float32 precision.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model.config.core import ConfigError

GREEDY_BELOW = float(np.finfo(np.float32).tiny)


class Sampling(NamedTuple):
    """temperature 0 (or below `GREEDY_BELOW`) = greedy; top_k 0 and top_p 1 disable those
    filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def validate(self) -> None:
        """ConfigError (a ValueError) naming the field (`temperature`, `top_k`, `top_p`)."""
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ConfigError("temperature", f"must be a finite number >= 0, got "
                              f"{self.temperature} (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError("top_k", f"must be an integer >= 0, got {self.top_k} (0 = off)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p} (1 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def token_probs(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """logits [..., V] -> probabilities [..., V] float32 of the sampling distribution."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    keep = jnp.ones(logits.shape, bool)
    if 0 < sampling.top_k < logits.shape[-1]:
        keep = logits >= jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
    # <= 0 and finite, whatever XLA makes of the division (x * (1 / T) is 0 for a huge T)
    temperature = min(sampling.temperature, float(np.finfo(np.float32).max))
    scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
    probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
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
