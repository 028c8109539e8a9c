"""The one reward interface every task's reward implements (report 5.2.2: rule verifiers for
verifiable tasks, a pairwise generative judge for the others)."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class Reward(Protocol):
    def score(self, problems: Sequence, responses: Sequence[str]) -> np.ndarray:
        """problems [n] (each with `.prompt`, `.answer`, `.solution`), the decoded responses [n]
        -> float32 [n] rewards."""
