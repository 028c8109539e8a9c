"""The arithmetic task as chats, for chat SFT (train/data/chat.py); shipped as
train/data/assets/chat_arith.jsonl (configs/sft_chat_arith.yaml trains on it).

    python -m train.data.chat_arith --out train/data/assets/chat_arith.jsonl --force
    records = chat_arith_records()   # the shipped file's records, in order

Each conversation is a system prompt and one to three user questions (`a op b`, phrased a few
ways), each answered by the number alone. The problems are those of `train.data.arithmetic`
minus the held-out ones (the hash split `python -m rl` evaluates on, `task.heldout_fraction`,
0.05 by default), so a model fine-tuned on the file has never seen an RL held-out problem.
Which problems are used, their order and their phrasing are decided by SHA-256 of the problem
keys (no random generator whose stream could change between library versions), so the output
is the same on every machine; a test checks that the shipped file is not stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from model.config.cli import ArgumentParser, finite_float
from train.data.arithmetic import Problem, arithmetic_problems, split_problems
from train.data.documents import heldout_score

SHIPPED = Path(__file__).parent / "assets" / "chat_arith.jsonl"
CONVERSATIONS = 700  # about 1400 problems, ~170 kB
HELDOUT_FRACTION = 0.05  # rl.config.TaskConfig.heldout_fraction's default
SYSTEM_PROMPTS = ("You are a calculator. Reply with the result only.",
                  "Answer each arithmetic question with a single number.")
QUESTIONS = ("What is {a} {op} {b}?", "{a}{op}{b}=", "Compute {a} {op} {b}.", "{a} {op} {b} = ?")
MAX_TURNS = 3


def _pick(salt: str, key: str, choices: int) -> int:
    """A deterministic choice in [0, choices) for `key` (SHA-256, like the split)."""
    return int(heldout_score(f"{salt}:{key}") * choices)


def chat_arith_records(conversations: int = CONVERSATIONS,
                       heldout_fraction: float = HELDOUT_FRACTION) -> list[dict]:
    """`conversations` chat records {"messages": [...]} over the train problems of the
    default arithmetic task (0 <= a, b <= 99, + and -)."""
    train, _ = split_problems(arithmetic_problems(), heldout_fraction)
    pool = sorted(train, key=lambda p: heldout_score(f"chat_arith:{p.key}"))
    records, used = [], 0
    for _ in range(conversations):
        turns = 1 + _pick("turns", pool[used].key, MAX_TURNS)
        problems = pool[used:used + turns]
        if len(problems) < turns:
            raise ValueError(f"--conversations {conversations}: more problems than the "
                             f"{len(pool)} of the task's train split")
        used += turns
        records.append({"messages": _conversation(problems)})
    return records


def _conversation(problems: list[Problem]) -> list[dict]:
    first = problems[0].key
    messages = [{"role": "system",
                 "content": SYSTEM_PROMPTS[_pick("system", first, len(SYSTEM_PROMPTS))]}]
    for p in problems:
        question = QUESTIONS[_pick("question", p.key, len(QUESTIONS))]
        messages += [{"role": "user", "content": question.format(a=p.a, op=p.op, b=p.b)},
                     {"role": "assistant", "content": str(p.answer)}]
    return messages


def jsonl_text(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m train.data.chat_arith", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, metavar="PATH",
                        help="jsonl to write (shipped: train/data/assets/chat_arith.jsonl)")
    parser.add_argument("--conversations", type=int, default=CONVERSATIONS, metavar="N")
    parser.add_argument("--heldout-fraction", type=finite_float, default=HELDOUT_FRACTION, metavar="F",
                        help="share of the problems held out for RL evaluation and so left "
                        "out (task.heldout_fraction)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.force:
        parser.error(f"--out {args.out} exists; pass --force to overwrite it")
    if args.conversations < 1:
        parser.error(f"--conversations must be >= 1, got {args.conversations}")
    if not 0 < args.heldout_fraction < 1:
        parser.error(f"--heldout-fraction must be in (0, 1), got {args.heldout_fraction}")
    try:
        records = chat_arith_records(args.conversations, args.heldout_fraction)
    except ValueError as err:
        parser.error(str(err))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(jsonl_text(records), encoding="utf-8")
    turns = sum(len(r["messages"]) // 2 for r in records)
    print(f"wrote {len(records)} conversations ({turns} problems) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
