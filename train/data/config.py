"""`train.data`: where a run's tokens come from (train/data); a field of `TrainConfig`
(train/config.py)."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from model.config import (
    Config,
    ConfigError,
    check_bool,
    check_int,
    check_open_fraction,
    check_positive,
)


@dataclasses.dataclass(frozen=True)
class DataConfig(Config):
    """Where tokens come from (train/data).

    `source`: `stdlib` (the running Python's standard-library `.py` files: real text on every
    machine, no download), `arith` / `arith_multistep` (procedural arithmetic problems,
    train/data/arithmetic.py, train/data/multistep.py) or a comma-separated list of them and of
    `.txt`/`.jsonl` paths or globs (a `.jsonl` of `messages` records is chat data, rendered with
    the tokenizer's chat template: train/data/chat.py), read into memory; or a directory of
    token shards (`python -m train.data.prepare`), read by index with bounded memory.
    `mixture`: {source: weight} in place of `source`, e.g. `{data/code: 0.3, data/web: 0.7}`:
    sources packed apart, their rows interleaved by weight (shares of the tokens).
    `tokenizer`: `default` (byte-level BPE trained once on the stdlib corpus and shipped),
    `arith_chars` (one token per character of the arithmetic task) or the path of a Hugging
    Face `tokenizer.json`.
    """

    section = "train.data"

    source: str = "stdlib"
    mixture: Mapping[str, float] = dataclasses.field(default_factory=dict)
    tokenizer: str = "default"
    heldout_fraction: float = 0.05  # share of documents (by path hash) kept for evaluation
    meta_tokens: bool = True  # report A.3: prepend "<|meta|>type=... lang=... source=...\n"
    # Report A.3 / Fig. 3 marker 4: after this many training tokens the metadata positions
    # leave the loss (eq. 8); 0 = masked from the start, -1 = never masked.
    meta_loss_mask_after_tokens: int = -1
    shuffle: bool = True
    num_workers: int = 0  # grain worker processes (0 = in-process)

    def validate(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ConfigError("source", "must be 'stdlib', .txt/.jsonl paths or a prepared dir")
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ConfigError("tokenizer", "must be 'default', 'arith_chars' or a "
                              "tokenizer.json path")
        check_open_fraction("heldout_fraction", self.heldout_fraction)
        check_bool("meta_tokens", self.meta_tokens)
        check_int("meta_loss_mask_after_tokens", self.meta_loss_mask_after_tokens, -1)
        check_bool("shuffle", self.shuffle)
        check_int("num_workers", self.num_workers, 0)
        if not isinstance(self.mixture, Mapping) or not all(
                isinstance(k, str) and k.strip() and "," not in k for k in self.mixture):
            raise ConfigError("mixture", "must map sources (a prepared directory or path each) "
                              f"to weights, e.g. {{data/code: 0.3}}, got {self.mixture!r}")
        for key, weight in self.mixture.items():
            check_positive(f"mixture[{key!r}]", weight)
        if self.mixture and self.source != "stdlib":
            raise ConfigError("mixture", f"takes the place of train.data.source; leave source "
                              f"unset (it is {self.source!r}) or remove the mixture")
