"""python -m model.chat (--workdir DIR | --hf HF_DIR) [--mesh tensor=T,expert=E]
    [--system TEXT] [--max-len N] [--max-new-tokens N] [--temperature T] [--top-k K]
    [--top-p P] [--prompt TEXT | --prompt-file PATH] [--json]

A multi-turn conversation with a model, one user message per line of stdin, replies streamed
as they are decoded (model/conversation.py): the chat template of the model's tokenizer
renders the history every turn, which is bounded by --max-len KV-cache positions (the oldest
exchanges are dropped to fit, and the turn says so). `/reset` forgets the history; `/exit`,
Ctrl-D or Ctrl-C at the prompt end the chat; Ctrl-C during a reply stops it. --prompt or
--prompt-file is the first message; --json prints one JSON object per turn (the rendered
prompt included) instead of streaming. Every other flag is `python -m model.generate`'s.
"""

from __future__ import annotations

import sys
from typing import Sequence

from model.generate import main as generate_main


def main(argv: Sequence[str] | None = None) -> int:
    return generate_main(sys.argv[1:] if argv is None else argv, prog="python -m model.chat",
                         description=__doc__, conversation=True)


if __name__ == "__main__":
    sys.exit(main())
