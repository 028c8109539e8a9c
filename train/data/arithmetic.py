"""The embedded procedural arithmetic task: `37+58=` -> `95`, `12-40=` -> `-28`.

    problems = arithmetic_problems(max_operand=99)        # every a op b, deterministic order
    train, heldout = split_problems(problems, 0.05)        # the same split as the SFT corpus
    arithmetic_documents()                                 # SFT documents "37+58=95"

A problem's split is decided by the SHA-256 of its key (`train.data.documents.heldout_score`),
exactly like a training document's, so the SFT warm start (`train.data.source=arith`) never sees
the held-out problems that RL evaluates on (`rl.trainer`). The character tokenizer `arith_chars`
(`model.tokenizers.arith_chars`) keeps every digit a separate token.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from train.data.documents import Document, heldout_score

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# Every problem is enumerated ((max_operand + 1)^2 x |ops| of them): 400^2 x 3 = 480k at most,
# about 100 MB and 2 s, the size of the multi-step task's space (train/data/multistep.py).
OPERAND_LIMIT = 399


@dataclasses.dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> int:
        return OPERATORS[self.op](self.a, self.b)

    @property
    def solution(self) -> str:
        """The reference response (the SFT target)."""
        return str(self.answer)

    @property
    def key(self) -> str:
        """Stable identity: decides the train/held-out split (as a document key would)."""
        return f"arith:{self.prompt}"


def arithmetic_problems(max_operand: int = 99, ops: str = "+-") -> list[Problem]:
    """Every `a op b` with 0 <= a, b <= max_operand, in a fixed order."""
    if not 1 <= max_operand <= OPERAND_LIMIT:
        raise ValueError(f"task.max_operand: must be in [1, {OPERAND_LIMIT}] (every problem is "
                         f"enumerated), got {max_operand}")
    unknown = set(ops) - set(OPERATORS)
    if not ops or unknown:
        raise ValueError(f"task.ops: must be a non-empty string of {''.join(OPERATORS)}, "
                         f"got {ops!r}")
    return [Problem(a, op, b) for op in dict.fromkeys(ops)
            for a in range(max_operand + 1) for b in range(max_operand + 1)]


def split_problems(problems: list[Problem], heldout_fraction: float
                   ) -> tuple[list[Problem], list[Problem]]:
    """(train, heldout) by the same rule as `train.data.documents.split_documents`."""
    heldout = [heldout_score(p.key) < heldout_fraction for p in problems]
    return ([p for p, h in zip(problems, heldout) if not h],
            [p for p, h in zip(problems, heldout) if h])


def sample_problems(problems: list[Problem], count: int, rng: np.random.Generator
                    ) -> list[Problem]:
    """`count` distinct problems (fewer if the pool is smaller), uniformly at random."""
    index = rng.choice(len(problems), size=min(count, len(problems)), replace=False)
    return [problems[i] for i in index]


def arithmetic_documents(max_operand: int = 99, ops: str = "+-") -> list[Document]:
    """SFT documents "a op b=answer", keyed like their problems (the corpus splits them)."""
    return [Document(p.key, p.prompt + p.solution, {"type": "Math", "source": "arith"})
            for p in arithmetic_problems(max_operand, ops)]
