"""Log-probabilities of given token sequences, through the decoder's KV-cache path.

    scorer = Scorer(decoder, batch_size=8)
    for logprobs, greedy in scorer.score([[5, 9, 2, 7], [3, 4]]):
        ...  # float64 [n - 1]: log p(x_i | x_<i) for i = 1..n-1; bool [n - 1]: x_i was the argmax

Rows are sorted by length and run `batch_size` at a time (short batches padded with empty rows,
so one compiled step serves every batch), each in chunks of the decoder's `prefill_chunk`
tokens that extend the rows' KV caches (`CausalLM.decode_chunk`, as prefill does): memory is
bounded by the chunk, whatever the length, and the logits are those generation samples from.
Log-softmax and argmax are taken in float32 over the whole vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from model.inference.decode import Decoder
from model.lm import CausalLM


class Scorer:
    def __init__(self, decoder: Decoder, batch_size: int):
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        self.decoder, self.batch_size = decoder, batch_size
        self._chunk = jax.jit(self._chunk_step, donate_argnums=1)

    def _chunk_step(self, variables, cache, tokens, positions, targets):
        """tokens, positions (-1 = padding), targets [B, C] -> (cache, log p(targets) [B, C],
        targets are the argmax [B, C])."""
        model = self.decoder.model
        (normed, _, _), mutated = model.apply({**variables, "cache": cache}, tokens, positions,
                                              method=CausalLM.decode_chunk, mutable=["cache"])
        logits = model.apply(variables, normed, method=CausalLM.project)
        logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
        return mutated["cache"], picked, jnp.argmax(logits, axis=-1) == targets

    def score(self, sequences: Sequence[Sequence[int]], progress: bool = False
              ) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each sequence of n >= 2 ids (at most the decoder's `max_len` + 1: the last id
        is only predicted, never cached): the log-probability of each token after the first
        given those before it [n - 1], and whether it was the most likely token [n - 1]."""
        lengths = np.array([len(s) for s in sequences])
        limit = self.decoder.spec.max_len + 1
        if len(lengths) and (lengths.min() < 2 or lengths.max() > limit):
            bad = int(np.flatnonzero((lengths < 2) | (lengths > limit))[0])
            raise ValueError(f"sequences[{bad}]: {lengths[bad]} tokens; scoring needs 2 to "
                             f"{limit} (the decoder's max_len + 1)")
        order = np.argsort(-lengths, kind="stable")  # similar lengths share a batch
        results: list = [None] * len(sequences)
        for start in tqdm(range(0, len(order), self.batch_size), desc="score", leave=False,
                          disable=not progress):
            rows = order[start:start + self.batch_size]
            for row, scored in zip(rows, self._score_batch([sequences[r] for r in rows])):
                results[row] = scored
        return results

    def _score_batch(self, sequences: list[Sequence[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        chunk = self.decoder.prefill_chunk
        width = -(-max(len(s) - 1 for s in sequences) // chunk) * chunk  # inputs: all but last
        tokens = np.zeros((self.batch_size, width), np.int32)
        targets = np.zeros((self.batch_size, width), np.int32)
        positions = np.full((self.batch_size, width), -1, np.int32)
        for b, sequence in enumerate(sequences):
            n = len(sequence) - 1
            tokens[b, :n], targets[b, :n] = sequence[:-1], sequence[1:]
            positions[b, :n] = np.arange(n)
        cache = self.decoder.init_cache(self.batch_size)
        picked, greedy = [], []
        for s in range(0, width, chunk):  # dispatched back to back: one transfer at the end
            cache, p, g = self._chunk(self.decoder.variables, cache, tokens[:, s:s + chunk],
                                      positions[:, s:s + chunk], targets[:, s:s + chunk])
            picked.append(p)
            greedy.append(g)
        picked, greedy = jax.device_get((picked, greedy))
        picked = np.concatenate(picked, axis=1).astype(np.float64)
        greedy = np.concatenate(greedy, axis=1)
        return [(picked[b, :len(s) - 1], greedy[b, :len(s) - 1]) for b, s in enumerate(sequences)]
