"""Rewards (report 5.2.2): a rule-based verifier for the arithmetic task and a GenRM helper.

Model output is only ever matched against a strict grammar, never evaluated: `parse_integer`
accepts a canonical ASCII decimal integer (optional minus sign, no leading zeros, at most 18
digits) and nothing else, so "12+1", "0x1F", "1e3", "٣", "(95)" or "__import__('os')" are
unparsable and earn zero reward.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]{0,17})", re.ASCII)


def parse_integer(text: str) -> int | None:
    """The integer a response states, or None if it is anything but one canonical integer
    (surrounding whitespace allowed)."""
    text = text.strip()
    if not _INTEGER.fullmatch(text) or text == "-0":
        return None
    return int(text)


def arithmetic_reward(response: str, answer: int) -> float:
    """1.0 for exactly the right integer, 0.0 for a wrong or unparsable response."""
    return 1.0 if parse_integer(response) == answer else 0.0


def arithmetic_rewards(responses: Sequence[str], answers: Sequence[int]) -> np.ndarray:
    """Batch form of `arithmetic_reward` -> float32 [len(responses)]."""
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    return np.array([arithmetic_reward(r, a) for r, a in zip(responses, answers)], np.float32)


def bradley_terry_reward(confidence, length=None, reference_length=None, *,
                         length_penalty: float = 0.0, rejected=None, eps: float = 1e-6):
    """Pairwise GenRM confidence -> Bradley-Terry win-rate reward in [0, 1] (report 5.2.2).

    `confidence` [N] or [N, K]: the GenRM's probability that the response beats the fixed
    reference, one per judgement (K judgements, e.g. both presentation orders, are pooled in
    logit space: the Bradley-Terry strength difference is the mean logit). Length control is
    a penalty on that strength: `length_penalty` logits per unit of relative excess length
    max(0, length / reference_length - 1). `rejected` [N] bool: responses a rule flagged
    (fabricated citations, language inconsistency, ...) get reward 0.
    Returns float64 [N]: sigmoid(strength)."""
    p = np.clip(np.asarray(confidence, np.float64), eps, 1.0 - eps)
    if not np.all(np.isfinite(p)):
        raise ValueError("bradley_terry_reward: confidences must be finite probabilities")
    logits = np.log(p) - np.log1p(-p)
    strength = logits.mean(axis=-1) if logits.ndim > 1 else logits
    if length_penalty:
        if length is None or reference_length is None:
            raise ValueError("bradley_terry_reward: length_penalty needs length and "
                             "reference_length")
        excess = np.maximum(0.0, np.asarray(length, np.float64)
                            / np.maximum(np.asarray(reference_length, np.float64), 1.0) - 1.0)
        strength = strength - length_penalty * excess
    reward = 1.0 / (1.0 + np.exp(-strength))
    if rejected is not None:
        reward = np.where(np.asarray(rejected, bool), 0.0, reward)
    return reward

