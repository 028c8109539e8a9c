"""The embedded multi-step arithmetic task: three operands, a worked line, a final answer line.

    12+7-5=          prompt
    19-5=14          worked line: the first operation carried out (a true chain of equalities)
    14               final answer line

    problems = multistep_problems(max_operand=20)     # every a op b op c, deterministic order
    train, heldout = split_problems(problems, 0.05)   # train.data.arithmetic's rule, own keys
    multistep_documents()                             # SFT documents "12+7-5=19-5=14\n14"

Operators apply left to right and are only + and -, so no precedence question arises. A
problem's split is decided by the SHA-256 of its key (`arith_multistep:12+7-5=`), like every
document's, so the SFT warm start (`train.data.source=arith_multistep`) never sees the held-out
problems RL evaluates on. The newline is the `arith_chars` tokenizer's last character.
"""

from __future__ import annotations

import dataclasses
import itertools

from train.data.arithmetic import OPERATORS
from train.data.documents import Document

SOURCE = "arith_multistep"
OPS = "+-"  # left-to-right evaluation is then the usual reading
OPERANDS = 3
DEFAULT_MAX_OPERAND = 20
# Every problem is enumerated ((max_operand + 1)^3 x |ops|^2 of them): 50^3 x 4 = 500k at most.
OPERAND_LIMIT = 49


@dataclasses.dataclass(frozen=True)
class ChainProblem:
    operands: tuple[int, ...]  # OPERANDS of them, each in [0, max_operand]
    ops: str  # one operator fewer than operands, applied left to right

    @property
    def prompt(self) -> str:
        return "".join(f"{a}{op}" for a, op in zip(self.operands, self.ops)) + \
            f"{self.operands[-1]}="

    @property
    def partial_results(self) -> list[int]:
        """The value after each operation, left to right; the last is the answer."""
        results, value = [], self.operands[0]
        for op, operand in zip(self.ops, self.operands[1:]):
            value = OPERATORS[op](value, operand)
            results.append(value)
        return results

    @property
    def answer(self) -> int:
        return self.partial_results[-1]

    @property
    def solution(self) -> str:
        """The reference response: the worked line, a newline, the final answer line. The
        worked line rewrites the expression after each operation: "19-5=14" for 12+7-5."""
        partial = self.partial_results
        steps = ["".join(f"{op}{b}" for op, b in zip(self.ops[i + 1:], self.operands[i + 2:]))
                 for i in range(len(partial))]
        worked = "=".join(f"{value}{rest}" for value, rest in zip(partial, steps))
        return f"{worked}\n{self.answer}"

    @property
    def key(self) -> str:
        """Stable identity: decides the train/held-out split (as a document key would)."""
        return f"{SOURCE}:{self.prompt}"


def multistep_problems(max_operand: int = DEFAULT_MAX_OPERAND, ops: str = OPS
                       ) -> list[ChainProblem]:
    """Every `a op b op c` with 0 <= a, b, c <= max_operand and ops from `ops`, in a fixed
    order."""
    if not 1 <= max_operand <= OPERAND_LIMIT:
        raise ValueError(f"max_operand: must be in [1, {OPERAND_LIMIT}] for the multi-step task "
                         f"(every problem is enumerated), got {max_operand}")
    if not ops or set(ops) - set(OPS):
        raise ValueError(f"ops: must be a non-empty string of {' '.join(OPS)}, got {ops!r}")
    operators = list(dict.fromkeys(ops))
    return [ChainProblem(operands, "".join(chosen))
            for chosen in itertools.product(operators, repeat=OPERANDS - 1)
            for operands in itertools.product(range(max_operand + 1), repeat=OPERANDS)]


def multistep_documents(max_operand: int = DEFAULT_MAX_OPERAND, ops: str = OPS
                        ) -> list[Document]:
    """SFT documents "prompt + solution", keyed like their problems (the corpus splits them)."""
    return [Document(p.key, p.prompt + p.solution, {"type": "Math", "source": SOURCE})
            for p in multistep_problems(max_operand, ops)]
