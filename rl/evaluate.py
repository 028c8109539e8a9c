"""Held-out exact-match accuracy of a policy on each task (its rule verifier), and pooled."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from model.inference.decode import Decoder
from model.inference.sampling import Sampling
from model.tokenizers.text import TextTokenizer
from rl.rewards.verifiers import RuleVerifier


def heldout_correct(decoder: Decoder, problems: Sequence, verifier: RuleVerifier,
                    sampling: Sampling, *, prompt_ids: dict[str, list[int]],
                    tokenizer: TextTokenizer, max_new_tokens: int, batch_size: int,
                    key: jax.Array | None = None) -> np.ndarray:
    """bool [len(problems)]: each problem answered exactly, one response each, decoded in
    batches of `batch_size` rows (the last batch is filled with repeats so every call has one
    shape)."""
    correct = [np.zeros(0, bool)]
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
        correct.append(verifier.score(chunk, texts) == 1.0)
    return np.concatenate(correct)


def heldout_scores(decoder: Decoder, tasks: Sequence, eval_prompts: int, sampling: Sampling,
                   name: str, **settings) -> dict[str, float]:
    """{name: accuracy over every task's evaluated problems pooled, f"{name}/{task}": per task}.
    Each task evaluates its first `eval_prompts` held-out problems (0 = all); `settings` are
    `heldout_correct`'s keywords (the same sampling key for every task)."""
    per_task = {task.name: heldout_correct(decoder, task.heldout[:eval_prompts or None],
                                           task.verifier, sampling, **settings)
                for task in tasks}
    pooled = np.concatenate(list(per_task.values()))
    return {name: float(pooled.mean()) if pooled.size else 0.0,
            **{f"{name}/{task}": float(c.mean()) for task, c in per_task.items() if c.size}}
