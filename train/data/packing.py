"""Packing: variable-length documents -> fixed [seq_len] rows of the five training features.

    tokens      int32  token ids; 0 on padding (a real id too: padding is segment_ids == 0)
    segment_ids int32  1, 2, 3, ... per document (piece) within the row, 0 = padding
    positions   int32  position inside the document piece, starting at 0
    meta_mask   bool   True on the metadata prefix M of a document (report A.3)
    loss_mask   bool   True on the tokens the loss may predict: every token of a plain document,
                       the assistant turns of a chat under train.loss_mask=assistant
                       (train/data/chat.py)

grain's ConcatThenSplitIterDataset does the work: documents are concatenated and cut every
seq_len tokens, so rows carry no padding (except the last row of a finite stream). A document
cut by a row boundary continues in the next row as a new segment starting at position 0, so a
document longer than seq_len becomes several segments, each attending only to itself (attention
and the loss never cross `segment_ids`).
"""

from __future__ import annotations

import grain
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset

FEATURES = ("tokens", "segment_ids", "positions", "meta_mask", "loss_mask")
DTYPES = {"tokens": np.int32, "segment_ids": np.int32, "positions": np.int32,
          "meta_mask": np.bool_, "loss_mask": np.bool_}
MASKS = ("meta_mask", "loss_mask")  # per-token features packed alongside the tokens


def document_example(meta_ids: np.ndarray | None, text_ids: np.ndarray,
                     eos_id: int | None) -> dict:
    """One document as s = [M; x; <|endoftext|>] (report A.3) with its metadata mask; every
    token is a target (the metadata's leave the loss by the meta_mask switch). No metadata
    prefix / end-of-text token where `meta_ids` / `eos_id` is None (a piece of a long text)."""
    meta_ids = np.zeros(0, np.int32) if meta_ids is None else meta_ids
    eos = [] if eos_id is None else [eos_id]
    tokens = np.concatenate([meta_ids, text_ids, eos]).astype(np.int32)
    meta_mask = np.zeros(len(tokens), np.bool_)
    meta_mask[:len(meta_ids)] = True
    return {"tokens": tokens, "meta_mask": meta_mask, "loss_mask": np.ones(len(tokens), np.bool_)}


def _rename(row: dict) -> dict:
    return {"tokens": row["tokens"], "segment_ids": row["tokens_segment_ids"],
            "positions": row["tokens_positions"], **{k: row[k] for k in MASKS}}


def pack(examples: grain.IterDataset, seq_len: int) -> grain.IterDataset:
    """{tokens, meta_mask, loss_mask} examples of any length -> rows of FEATURES, each
    [seq_len]."""
    # The masks are packed like tokens (same length, so cut at the same places); their own
    # segment ids / positions would duplicate the tokens' and are dropped by _rename.
    packed = ConcatThenSplitIterDataset(
        examples, length_struct={"tokens": seq_len, **{k: seq_len for k in MASKS}})
    return packed.map(_rename)


def padding_rows(count: int, seq_len: int) -> dict:
    return {k: np.zeros((count, seq_len), DTYPES[k]) for k in FEATURES}


def pad_batch(batch: dict, batch_size: int) -> dict:
    """Completes a short final batch with all-padding rows (segment 0), keeping shapes static."""
    missing = batch_size - len(batch["tokens"])
    if missing <= 0:
        return batch
    pad = padding_rows(missing, batch["tokens"].shape[1])
    return {k: np.concatenate([batch[k], pad[k]]) for k in FEATURES}


def unpack(row: dict) -> list[dict]:
    """Inverse view of one packed row: its segments in order, each {tokens, meta_mask,
    loss_mask} (for tests and debugging)."""
    segments = []
    for sid in np.unique(row["segment_ids"][row["segment_ids"] > 0]):
        where = row["segment_ids"] == sid
        segments.append({k: row[k][where] for k in ("tokens", *MASKS)})
    return segments
