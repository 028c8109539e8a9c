"""Document -> training example {tokens, meta_mask, loss_mask}: what the pipeline packs, and what
`python -m train.data.prepare` stores in token shards.

    encode = DocumentEncoder(tokenizer, meta_tokens=True)
    example = encode(doc)    # s = [M; x; <|endoftext|>] (report A.3), or a rendered chat

A text longer than PIECE_BYTES characters is tokenized piece by piece (cut after a newline), so
a huge document costs the tokenizer's memory of one piece, not of the whole text (a single
encode call of a 30 MB text holds gigabytes).
"""

from __future__ import annotations

import numpy as np

from model.tokenizers.chat import ChatTokenizer
from model.tokenizers.text import TextTokenizer
from train.data.chat import chat_example
from train.data.documents import Document
from train.data.packing import document_example
from train.data.corpus import meta_string
from train.data.readers import PIECE_BYTES


def encode_long(tokenizer: TextTokenizer, text: str, limit: int = PIECE_BYTES) -> np.ndarray:
    """`tokenizer.encode(text)`, one piece of at most `limit` characters at a time."""
    if len(text) <= limit:
        return tokenizer.encode(text)
    pieces, start = [], 0
    while start < len(text):
        stop = min(start + limit, len(text))
        if stop < len(text):
            stop = text.rfind("\n", start + limit // 2, stop) + 1 or stop
        pieces.append(tokenizer.encode(text[start:stop]))
        start = stop
    return np.concatenate(pieces)


class DocumentEncoder:
    """Document -> {tokens, meta_mask, loss_mask} example (a picklable callable, for worker
    processes). Chats are rendered by `chat` (train/data/chat.py), trained on their assistant
    turns only if `assistant_only`. A piece of a longer text (Document.starts / ends) takes the
    metadata prefix only if it starts the text and the end-of-text token only if it ends it."""

    def __init__(self, tokenizer: TextTokenizer, meta_tokens: bool,
                 chat: ChatTokenizer | None = None, assistant_only: bool = False):
        self.tokenizer, self.meta_tokens = tokenizer, meta_tokens
        self.chat, self.assistant_only = chat, assistant_only

    def __call__(self, doc: Document) -> dict:
        if doc.chat is not None:
            return chat_example(self.chat, doc, self.assistant_only)
        tok = self.tokenizer
        meta = None
        if self.meta_tokens and doc.starts:
            meta = np.concatenate([[tok.meta_open_id], tok.encode(meta_string(doc.meta)),
                                   [tok.meta_close_id]]).astype(np.int32)
        return document_example(meta, encode_long(tok, doc.text), tok.eos_id if doc.ends else None)
