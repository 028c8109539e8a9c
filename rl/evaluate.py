"""Held-out exact-match accuracy of a policy on the arithmetic task."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from model.inference.decode import Decoder
from model.inference.sampling import Sampling
from model.tokenizers.text import TextTokenizer
from rl.rewards import arithmetic_rewards
from train.data.arithmetic import Problem


def heldout_accuracy(decoder: Decoder, problems: Sequence[Problem], sampling: Sampling, *,
                     prompt_ids: dict[str, list[int]], tokenizer: TextTokenizer,
                     max_new_tokens: int, batch_size: int, key: jax.Array | None = None
                     ) -> float:
    """Fraction of `problems` answered exactly, one response each, decoded in batches of
    `batch_size` rows (the last batch is filled with repeats so every call has one shape)."""
    correct = []
    key = jax.random.key(0) if key is None else key
    for start in range(0, len(problems), batch_size):
        chunk = list(problems[start:start + batch_size])
        rows = chunk + [chunk[-1]] * (batch_size - len(chunk))
        key, chunk_key = jax.random.split(key)
        generation = decoder.generate([prompt_ids[p.prompt] for p in rows], max_new_tokens,
                                      sampling=sampling, key=chunk_key,
                                      stop_ids=(tokenizer.eos_id,))
        eos = tokenizer.eos_id
        texts = [tokenizer.decode(t[:-1] if t[-1] == eos else t)
                 for t in generation.tokens[:len(chunk)]]
        correct.append(arithmetic_rewards(texts, [p.answer for p in chunk]))
    return float(np.concatenate(correct).mean()) if correct else 0.0
