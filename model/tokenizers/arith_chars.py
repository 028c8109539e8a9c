"""The `arith_chars` tokenizer of the arithmetic task: one token per character, so every digit
is its own token (`train.data.arithmetic`, `train.data.multistep`, `rl.rewards`).

The shipped asset `model/tokenizers/assets/arith_chars.json` is `char_tokenizer()` saved; a test
checks that it is not stale.
"""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models

from model.tokenizers.text import SPECIAL_TOKENS

# The tasks' alphabet (the tokenizer's non-special tokens). Characters are only ever appended, so
# existing ids keep their meaning: the newline (id 17) separates the multi-step task's worked
# line from its final answer line. 3 special + 15 ids fit the models' vocab_size of 32.
CHARACTERS = "0123456789+-*=\n"


def char_tokenizer() -> tokenizers.Tokenizer:
    """One token per character of CHARACTERS after the special tokens (ids 0, 1, 2)."""
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.add_special_tokens(list(SPECIAL_TOKENS))
    hf.decoder = decoders.Fuse()
    return hf
