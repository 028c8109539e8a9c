"""A training document and the rule that splits documents into train and held-out.

The split is a pure function of the document's key, so adding or removing other files never
moves a document between splits, and a procedural task (`train.data.arithmetic`) keys its
problems the same way its SFT documents are keyed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class Document:
    key: str  # location-independent (a relative path; jsonl: path:line): decides the split
    text: str  # a chat: its messages' contents, one per line (what tokenizer training reads)
    meta: Mapping[str, str]  # subset of META_FIELDS
    # A chat (train/data/chat.py): {"messages": [...], "tools": [...] or None}, which the
    # pipeline renders with the tokenizer's chat template instead of encoding `text`.
    chat: Mapping[str, Any] | None = None
    # A long text file is read in pieces (train/data/readers.py), each a Document of the same
    # key: the piece that starts the text takes the metadata prefix, the one that ends it the
    # end-of-text token.
    starts: bool = True
    ends: bool = True


def heldout_score(key: str) -> float:
    """Uniform in [0, 1), a pure function of the key (sha256, stable across runs/machines)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def split_documents(docs: list[Document], heldout_fraction: float
                    ) -> tuple[list[Document], list[Document]]:
    """(train, heldout): a document is held out iff heldout_score(key) < fraction, so adding or
    removing other files never moves a document between splits."""
    heldout = [heldout_score(d.key) < heldout_fraction for d in docs]
    return ([d for d, h in zip(docs, heldout) if not h], [d for d, h in zip(docs, heldout) if h])
