"""A generative pairwise judge (report 5.2.2, GenRM) as a `Reward`.

    judge = PairwiseJudge.from_checkpoint("runs/judge", length_penalty=0.5)
    rewards = judge.score(problems, responses)          # float32 [n]

Any stepjax or Hugging Face checkpoint (`model.weights.load_model`) reads a rendered template
(question, response A, response B, "Which response is better? Answer A or B:") and its next-token
distribution, restricted to the two choice tokens, is the confidence that A wins. As in 5.2.2
every response is compared with a fixed reference: the problem's reference solution (the SFT
target). Both presentation orders are judged (response as A, then as B), which cancels the
judge's position bias; `bradley_terry_reward` pools the two confidences in logit space and
subtracts the length penalty (relative excess of the response's length over the reference's,
both counted in the judge's tokens). One forward pass per batch, jitted, rows right-padded to a
power-of-two length so few shapes are compiled.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ConfigError, ModelConfig
from model.lm import CausalLM
from model.tokenizers.text import TextTokenizer
from model.weights import checkpoint_tokenizer, load_model
from rl.rewards.bradley_terry import bradley_terry_reward
from rl.rewards.template import (DEFAULT_CHOICES, DEFAULT_TEMPLATE, literal_pieces, render,
                                 template_error)

MIN_LENGTH = 16  # shortest padded row length


def choice_probabilities(model: CausalLM, variables, tokens, segment_ids, last, choice_ids):
    """tokens, segment_ids [B, T], last [B] (index of each row's last real token), choice_ids
    [2] -> float32 [B, 2]: the next-token distribution after `last` renormalised over the two
    choice tokens (a softmax of their two logits). Only the B last positions are projected to
    the vocabulary, so no [B, T, V] array exists."""
    out = model.apply(variables, tokens, segment_ids, compute_logits=False, num_mtp_heads=0)
    hidden = out.hidden[jnp.arange(tokens.shape[0]), last]  # [B, D]
    logits = model.apply(variables, hidden, method=CausalLM.project)  # [B, V]
    return jax.nn.softmax(logits[:, choice_ids].astype(jnp.float32), axis=-1)


@functools.cache
def _compiled_choice_probabilities(config: ModelConfig):
    """One jitted `choice_probabilities` per judge architecture (judges of one run share it)."""
    return jax.jit(functools.partial(choice_probabilities, CausalLM(config)))


class PairwiseJudge:
    """Judges responses against reference responses with a causal LM (see the module doc)."""

    def __init__(self, config: ModelConfig, variables: dict, tokenizer: TextTokenizer, *,
                 template: str = DEFAULT_TEMPLATE, choices: Sequence[str] = DEFAULT_CHOICES,
                 length_penalty: float = 0.0, batch_size: int = 32):
        problem = template_error(template)
        if problem:
            raise ConfigError("template", problem)
        if tokenizer.get_vocab_size() > config.vocab_size:
            raise ConfigError("tokenizer", f"{tokenizer.name!r} has {tokenizer.get_vocab_size()} "
                              f"tokens but the judge's vocab_size is {config.vocab_size}")
        unspellable = [p for p in literal_pieces(template)
                       if tokenizer.decode(tokenizer.encode(p)) != p]
        if unspellable:
            raise ConfigError("template", f"the judge's tokenizer {tokenizer.name!r} cannot "
                              f"spell {unspellable[0]!r}")
        self.choice_ids = np.asarray([_single_token(tokenizer, c) for c in choices], np.int32)
        self.tokenizer, self.template = tokenizer, template
        self.length_penalty, self.batch_size = length_penalty, batch_size
        self.variables = variables
        self._probabilities = _compiled_choice_probabilities(config)

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path, tokenizer: str = "", **settings
                        ) -> "PairwiseJudge":
        """A stepjax model directory, HF checkpoint, training or RL workdir, and its
        tokenizer: `tokenizer` names it (as `rl.tokenizer` does); "" takes the checkpoint's own
        (`model.weights.checkpoint_tokenizer`)."""
        config, variables = load_model(checkpoint)
        return cls(config, variables, checkpoint_tokenizer(Path(checkpoint), tokenizer),
                   **settings)

    def confidences(self, questions: Sequence[str], responses: Sequence[str],
                    references: Sequence[str]) -> np.ndarray:
        """float64 [n, 2]: the judge's probability that response i beats reference i, with the
        response shown as A (column 0) and as B (column 1)."""
        n = len(responses)
        if not len(questions) == len(references) == n:
            raise ValueError(f"{len(questions)} questions, {n} responses and {len(references)} "
                             "references")
        as_a = [render(self.template, question=q, response_a=r, response_b=ref)
                for q, r, ref in zip(questions, responses, references)]
        as_b = [render(self.template, question=q, response_a=ref, response_b=r)
                for q, r, ref in zip(questions, responses, references)]
        probabilities = self._judge_prompts(as_a + as_b)  # [2n, 2]
        return np.stack([probabilities[:n, 0], probabilities[n:, 1]], axis=1)

    def score(self, problems: Sequence, responses: Sequence[str]) -> np.ndarray:
        """problems [n] (`.prompt` is the question, `.solution` the reference), responses [n]
        -> float32 [n] Bradley-Terry rewards (report 5.2.2)."""
        references = [p.solution for p in problems]
        confidence = self.confidences([p.prompt for p in problems], responses, references)
        length = [len(t) for t in self.tokenizer.encode_batch(list(responses))]
        reference_length = [len(t) for t in self.tokenizer.encode_batch(references)]
        return bradley_terry_reward(confidence, length, reference_length,
                                    length_penalty=self.length_penalty).astype(np.float32)

    def _judge_prompts(self, texts: list[str]) -> np.ndarray:
        """Rendered prompts [m] -> float64 [m, 2], `batch_size` rows per forward pass (the last
        batch filled with repeats so every call has one of few shapes)."""
        rows = self.tokenizer.encode_batch(texts)
        out = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start:start + self.batch_size]
            chunk = chunk + [chunk[-1]] * (self.batch_size - len(chunk))
            length = max(MIN_LENGTH, 1 << (max(map(len, chunk)) - 1).bit_length())
            tokens = np.zeros((self.batch_size, length), np.int32)
            segments = np.zeros((self.batch_size, length), np.int32)
            for i, row in enumerate(chunk):
                tokens[i, :len(row)], segments[i, :len(row)] = row, 1
            last = np.asarray([len(row) - 1 for row in chunk], np.int32)
            probabilities = self._probabilities(self.variables, tokens, segments, last,
                                                self.choice_ids)
            out.append(np.asarray(probabilities, np.float64)[:len(rows) - start])
        return np.concatenate(out)


def _single_token(tokenizer: TextTokenizer, choice: str) -> int:
    ids = tokenizer.encode(choice)
    if len(ids) != 1 or tokenizer.decode(ids) != choice:
        raise ConfigError("choices", f"{choice!r} is not one token of the judge's tokenizer "
                          f"{tokenizer.name!r} (it encodes to {ids.tolist()})")
    return int(ids[0])
