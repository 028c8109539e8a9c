"""The GenRM reward of report 5.2.2: pairwise confidences -> Bradley-Terry win-rate reward."""

from __future__ import annotations

import numpy as np


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
