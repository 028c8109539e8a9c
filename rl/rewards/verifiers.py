"""Rule-based verifiers (report 5.2.2, RLVR): one per task, each a strict grammar.

Model output is only ever matched against a strict grammar, never evaluated: `parse_integer`
accepts a canonical ASCII decimal integer (optional minus sign, no leading zeros, at most 18
digits) and nothing else, so "12+1", "0x1F", "1e3", "٣", "(95)" or "__import__('os')" are
unparsable and earn zero reward.

- arithmetic (`37+58=` -> `95`): the whole response is the integer;
- multistep (`12+7-5=` -> `19-5=14\\n14`): one or more worked lines, then a final answer line that
  is exactly the integer. Only the final answer line is graded (as math verifiers grade the final
  answer); the worked lines must be present and non-empty but are never read further.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np

_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]{0,17})", re.ASCII)


def parse_integer(text: str) -> int | None:
    """The integer a response states, or None if it is anything but one canonical integer
    (surrounding whitespace allowed)."""
    text = text.strip()
    if not _INTEGER.fullmatch(text) or text == "-0":
        return None
    return int(text)


def final_answer(response: str) -> int | None:
    """The integer on the last line of "worked line(s)\\nanswer", or None: no worked line, an
    empty worked line, or a last line that is not exactly one canonical integer (no whitespace
    around it either)."""
    *worked, last = response.split("\n")
    if not worked or not all(worked) or last != last.strip():
        return None
    return parse_integer(last)


def arithmetic_reward(response: str, answer: int) -> float:
    """1.0 for exactly the right integer, 0.0 for a wrong or unparsable response."""
    return 1.0 if parse_integer(response) == answer else 0.0


def multistep_reward(response: str, answer: int) -> float:
    """1.0 for worked line(s) then exactly the right final answer line, else 0.0."""
    return 1.0 if final_answer(response) == answer else 0.0


def arithmetic_rewards(responses: Sequence[str], answers: Sequence[int]) -> np.ndarray:
    """Batch form of `arithmetic_reward` -> float32 [len(responses)]."""
    return _rewards(arithmetic_reward, responses, answers)


def multistep_rewards(responses: Sequence[str], answers: Sequence[int]) -> np.ndarray:
    """Batch form of `multistep_reward` -> float32 [len(responses)]."""
    return _rewards(multistep_reward, responses, answers)


def _rewards(reward: Callable[[str, int], float], responses: Sequence[str],
             answers: Sequence[int]) -> np.ndarray:
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    return np.array([reward(r, a) for r, a in zip(responses, answers)], np.float32)


class RuleVerifier:
    """A task's rule as a `Reward`: exact-match rewards of a batch of responses."""

    def __init__(self, rewards: Callable[[Sequence[str], Sequence[int]], np.ndarray]):
        self.rewards = rewards

    def score(self, problems: Sequence, responses: Sequence[str]) -> np.ndarray:
        """problems [n] (with `.answer`), responses [n] -> float32 [n] in {0, 1}."""
        return self.rewards(responses, [p.answer for p in problems])
