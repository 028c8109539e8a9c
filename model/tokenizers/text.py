"""Tokenizers: the shipped byte-level BPE of the stdlib corpus, or any Hugging Face tokenizer.json.

    tok = load_tokenizer("default")            # model/tokenizers/assets/stdlib_bpe_4096.json
    ids = tok.encode("def f(x):\n    return x\n")   # int32 array, no special tokens
    tok.eos_id, tok.meta_open_id, tok.meta_close_id, tok.get_vocab_size()

`train_bpe` builds the shipped asset; `python -m train.tokenizer` re-trains it on the corpus
(deterministic for a given Python version and corpus).

Special tokens are only ever inserted by id (`encode` treats their spelling inside a document
as plain text), so data can never forge a document boundary or a metadata delimiter.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"  # document separator / end of sequence
META_OPEN, META_CLOSE = "<|meta|>", "<|/meta|>"  # report A.3 metadata delimiters
SPECIAL_TOKENS = (EOS, META_OPEN, META_CLOSE)
# End-of-document tokens of common tokenizers, tried in order for a foreign tokenizer.json.
EOS_CANDIDATES = (EOS, "<|end_of_text|>", "</s>", "<eos>", "<|end▁of▁sentence|>")
DEFAULT_PATH = Path(__file__).parent / "assets" / "stdlib_bpe_4096.json"
# Tokenizers shipped under model/tokenizers/assets, by name (`model.tokenizers.arith_chars` builds
# `arith_chars`).
SHIPPED = {"default": DEFAULT_PATH, "arith_chars": DEFAULT_PATH.parent / "arith_chars.json"}


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the ids of the three special tokens the data pipeline
    needs. A foreign tokenizer lacking `<|meta|>` / `<|/meta|>` (or any known end-of-text
    token) gets them appended, which grows its vocabulary by up to three ids."""

    def __init__(self, hf: tokenizers.Tokenizer, name: str = ""):
        self.hf, self.name = hf, name
        present = hf.get_vocab(with_added_tokens=True)
        eos = next((t for t in EOS_CANDIDATES if t in present), EOS)
        missing = [t for t in (eos, META_OPEN, META_CLOSE) if t not in present]
        if missing:
            hf.add_special_tokens(missing)
        hf.encode_special_tokens = True  # a document's "<|endoftext|>" is text, not a boundary
        self.eos_id = hf.token_to_id(eos)
        self.meta_open_id = hf.token_to_id(META_OPEN)
        self.meta_close_id = hf.token_to_id(META_CLOSE)
        self.vocab_size = max(hf.get_vocab(with_added_tokens=True).values()) + 1

    def __reduce__(self):  # pickled for grain worker processes: rebuild from the JSON
        return _from_json, (self.hf.to_str(), self.name)

    def get_vocab_size(self) -> int:
        """Ids are in [0, vocab_size): the model's `vocab_size` must be at least this."""
        return self.vocab_size

    def fingerprint(self) -> str:
        """sha256 of the vocabulary (token -> id, special tokens included): equal for the same
        tokenizer whatever file or library version it was read from, different as soon as one
        id means another token (a model trained with one reads the other's ids as noise)."""
        vocab = sorted(self.hf.get_vocab(with_added_tokens=True).items(), key=lambda t: t[1])
        return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.hf.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self.hf.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in encodings]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"TextTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def _from_json(text: str, name: str) -> TextTokenizer:
    return TextTokenizer(tokenizers.Tokenizer.from_str(text), name)


def load_tokenizer(spec: str = "default") -> TextTokenizer:
    """`default` -> the shipped stdlib BPE, `arith_chars` -> the shipped character tokenizer of
    the arithmetic task; otherwise the path of a Hugging Face tokenizer.json (or of a directory
    holding one, e.g. a downloaded model)."""
    path = SHIPPED.get(spec, Path(spec))
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"train.data.tokenizer: {spec!r} is a directory without a "
                             "tokenizer.json; name the tokenizer.json or a directory holding one")
        path = path / "tokenizer.json"
    if not path.is_file():
        hint = " (the shipped tokenizer asset is missing)" if spec in SHIPPED else ""
        raise ValueError(f"train.data.tokenizer: {spec!r} does not exist{hint}")
    try:
        hf = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises bare Exception on malformed files
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"train.data.tokenizer: {spec!r} is not a Hugging Face tokenizer.json "
                         f"({reason})") from None
    return TextTokenizer(hf, name=spec)


def train_bpe(texts: Sequence[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation, no normaliser: lossless on any text), with
    the special tokens at ids 0, 1, 2."""
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return hf
