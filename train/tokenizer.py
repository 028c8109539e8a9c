"""`python -m train.tokenizer`: re-train the shipped byte-level BPE on the corpus.

    python -m train.tokenizer --vocab-size 4096 \\
        --out model/tokenizers/assets/stdlib_bpe_4096.json --force

Tokenizers themselves live in `model.tokenizers`; `load_tokenizer` is re-exported here, its
documented path.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Sequence

from model.config import check_open_fraction
from model.config.cli import ArgumentParser, finite_float
from model.tokenizers.text import DEFAULT_PATH, SPECIAL_TOKENS, load_tokenizer, train_bpe
from train.data.config import DataConfig
from train.data.corpus import load_documents
from train.data.documents import split_documents

__all__ = ["load_tokenizer", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m train.tokenizer",
        description="Train the byte-level BPE tokenizer on the train split of the stdlib corpus.")
    parser.add_argument("--vocab-size", type=int, default=4096, metavar="N",
                        help="(default 4096)")
    parser.add_argument("--out", type=Path, default=DEFAULT_PATH, metavar="PATH",
                        help="tokenizer.json to write (default: the shipped one, "
                             f"{DEFAULT_PATH.relative_to(DEFAULT_PATH.parents[3])})")
    parser.add_argument("--source", default="stdlib", help="corpus (as train.data.source)")
    parser.add_argument("--heldout-fraction", type=finite_float, default=DataConfig.heldout_fraction,
                        metavar="F", help="documents of the held-out split are left out of "
                                          "training")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    args = parser.parse_args(argv)
    if args.vocab_size < 256 + len(SPECIAL_TOKENS):
        parser.error(f"--vocab-size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials)")
    if args.out.exists() and not args.force:
        parser.error(f"--out {args.out} exists; pass --force to overwrite it")
    try:
        check_open_fraction("--heldout-fraction", args.heldout_fraction)
        train_docs, _ = split_documents(load_documents(args.source), args.heldout_fraction)
    except ValueError as err:
        parser.error(str(err))
    start = time.perf_counter()
    hf = train_bpe([d.text for d in train_docs], args.vocab_size)
    seconds = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    hf.save(str(args.out))
    chars = sum(len(d.text) for d in train_docs)
    tokens = sum(len(e.ids) for e in hf.encode_batch_fast([d.text for d in train_docs]))
    print(f"trained vocab {hf.get_vocab_size()} on {len(train_docs)} documents "
          f"({chars / 1e6:.1f}M chars, Python {sys.version.split()[0]}) in {seconds:.1f}s; "
          f"{chars / tokens:.2f} chars/token; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
