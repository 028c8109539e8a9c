"""DAPO's overlong reward shaping (Yu et al. 2025, 3.4 "Soft Overlong Punishment"): a length
penalty added to the reward of responses that run into the last L_cache tokens of the budget.

    R_length(y) = 0                               if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                = -1                              if |y| > L_max

L_max = `rl.max_new_tokens`, L_cache = `rl.overlong_buffer` (0 = off). |y| counts the response's
tokens as the loss sees them, its stop token included. A truncated response has |y| = L_max and
gets -1: the penalty ramps linearly from 0 to -1 across the buffer, so the policy learns that
the limit is near before it hits it (DAPO's motivation: a truncated correct answer punished
like a wrong one is reward noise).
"""

from __future__ import annotations

import numpy as np


def overlong_penalty(lengths, max_length: int, buffer: int) -> np.ndarray:
    """R_length of each response: lengths [B] (tokens) -> float32 [B], in [-1, 0]."""
    lengths = np.asarray(lengths, np.float64)
    if buffer == 0:
        return np.zeros(lengths.shape, np.float32)
    start = max_length - buffer  # the buffer begins after this many tokens
    penalty = np.where(lengths <= start, 0.0, (start - lengths) / buffer)
    return np.maximum(penalty, -1.0).astype(np.float32)
