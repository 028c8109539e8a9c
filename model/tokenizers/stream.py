"""Streaming detokenization: text to print as token ids arrive, equal in the end to decoding
them all at once.

    stream = TextStream(lambda ids: tok.decode(ids, skip_special_tokens=True))
    for ids in new_tokens:             # e.g. Decoder.generate(..., on_tokens=...)
        print(stream.push(ids), end="", flush=True)
    print(stream.flush())

Each push decodes the tokens since the last printed piece together with the few before it and
prints what that adds to their own decoding, so a token whose text depends on its neighbour (a
leading space a SentencePiece decoder drops at the start of a text) comes out right, and
nothing is printed while the text ends inside a character (a multi-byte UTF-8 sequence split
over tokens decodes to U+FFFD until its last byte arrives). Decoding stays short: only tokens
since the last printed piece are re-decoded.
"""

from __future__ import annotations

from typing import Callable, Sequence

INCOMPLETE = "\ufffd"  # what a byte-level decoder gives for a partial UTF-8 sequence


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.context = 0  # ids[context:printed] decode to text already printed
        self.printed = 0  # ids before this are printed

    def push(self, ids: Sequence[int]) -> str:
        """The text `ids` add to what was printed ('' while it ends inside a character)."""
        self.ids.extend(int(i) for i in ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is left, incomplete characters included (at the end of generation)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self.decode(self.ids[self.context:self.printed])
        text = self.decode(self.ids[self.context:])
        if len(text) <= len(before) or (text.endswith(INCOMPLETE) and not final):
            return ""
        self.context, self.printed = self.printed, len(self.ids)
        return text[len(before):]
