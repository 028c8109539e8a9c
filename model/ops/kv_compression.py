"""KV compression of DeepSeek-V4's compressed attention layers (DeepSeek-V4 report §2.3).

Every block of m consecutive tokens becomes one compressed KV entry: a per-channel softmax
pooling of the block's projected entries C = H·W^KV under gate logits Z = H·W^Z plus a
learned per-slot bias B (the softmax runs over the slots, separately for each channel).
- HCA (eqs. 20-23): blocks of m' tokens, no overlap; params `kv_proj`/`gate_proj` [d, c],
  `position_bias` [m', c].
- CSA (eqs. 9-12): overlapped; the projections are [d, 2c] and the bias [m, 2c]. Entry i pools
  2m slots: the *first* c channels of block i-1 (its "previous-block" series) and the *last* c
  channels of block i. The first block of a document has no previous block (the "boundary
  block"): those m slots get gate -inf and value 0, i.e. softmax weight 0 (eq. 11's padding).
  Hugging Face's `DeepseekV4CSACompressor` lays the halves out the same way ([:c] previous).
Each entry is then RMS-normalised with the learned scale `kv_norm` (the checkpoint's
`compressor.kv_norm.weight`, applied as is, not as an offset) and its trailing rope channels
are rotated at the position of the block's *first* token (w·m for block w), as upstream: the
caller's position of that token, so entries and queries share one coordinate system whatever
positions the caller passes (per-document offsets by default).

Packed documents (report §3.5.3's "compressed independently per sequence"; upstream has no
packing): blocks are aligned to each document's start and never span two documents. A
document's trailing tokens that do not fill a block produce no entry (upstream drops the
same tail), so a packed document compresses exactly as it would alone. With n_e complete
blocks per document, a row holds Σ n_e ≤ T // m entries: they are compacted, in order, into
the first slots of a fixed [B, T // m] buffer; the rest are empty slots (value 0, never
visible). Which query sees which entry is `CompressedKV.visible`.

Parameter names map 1:1 onto the checkpoint's `self_attn.compressor.*` (CSA indexers:
`self_attn.compressor.indexer.*`) tensors; the projections are stored [in, out] here,
transposed from torch's `nn.Linear.weight`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from model.ops.interleaved_rope import rotate_trailing_pairs

_NEG = -1e30  # finite "-inf" for empty slots: exp underflows to exactly 0, gradients stay finite


class CompressorParams(NamedTuple):
    kv_proj: jax.Array  # [d, c] HCA, [d, 2c] CSA (HF `kv_proj.weight`.T)
    gate_proj: jax.Array  # same shape as kv_proj (HF `gate_proj.weight`.T)
    position_bias: jax.Array  # [m, c] HCA, [m, 2c] CSA (HF `position_bias`)
    kv_norm: jax.Array  # [c] (HF `kv_norm.weight`)


class CompressedKV(NamedTuple):
    """A row's compressed entries in token order, padded to N = T // m slots."""

    entries: jax.Array  # [B, N, c]
    last_token: jax.Array  # [B, N] int32: index of the block's last token; T for empty slots
    segment_ids: jax.Array  # [B, N] int32: the document of the block

    def visible(self, query_index: jax.Array, query_segment: jax.Array) -> jax.Array:
        """query_index/query_segment: [B, Q] -> bool [B, Q, N]. Query t sees entry w iff the
        whole block is at or before t and in t's document. As upstream (`(t + 1) // m > w`),
        a query at a block's last token already sees that block's entry."""
        complete = self.last_token[:, None, :] <= query_index[:, :, None]
        return complete & (self.segment_ids[:, None, :] == query_segment[:, :, None])


def document_offsets(segment_ids: jax.Array) -> jax.Array:
    """[B, T] -> [B, T] int32: each token's offset from the start of its document (a document
    is a run of equal segment ids)."""
    length = segment_ids.shape[1]
    index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def block_starts(segment_ids: jax.Array, rate: int) -> jax.Array:
    """[B, T] -> [B, T // rate] int32: first token of each complete document-aligned block, in
    order, then T for empty slots."""
    return complete_blocks(document_offsets(segment_ids), rate, segment_ids.shape[1] // rate)


def complete_blocks(offsets: jax.Array, rate: int, slots: int, first_end: int = 0) -> jax.Array:
    """offsets [B, R]: the rows' offsets in their documents (-1: no token) -> [B, slots] int32:
    the first row of each complete document-aligned block whose last row is at or after
    `first_end`, in order, then R for empty slots (and blocks past `slots`)."""
    batch, rows = offsets.shape
    index = jnp.arange(rows)
    last = jnp.minimum(index + rate - 1, rows - 1)
    # The block's last token is rate-1 further into the same document iff no document starts
    # inside the block (a restart would make its offset smaller).
    complete = (index + rate - 1 < rows) & (offsets[:, last] == offsets + rate - 1)
    is_start = complete & (offsets % rate == 0) & (index + rate - 1 >= first_end)
    slot = jnp.where(is_start, jnp.cumsum(is_start, axis=1) - 1, slots)
    starts = jnp.full((batch, slots), rows, jnp.int32)
    batch_rows = jnp.arange(batch)[:, None]
    return starts.at[batch_rows, slot].set(jnp.broadcast_to(index, (batch, rows)), mode="drop")


def _gather_blocks(x: jax.Array, first: jax.Array, rate: int) -> jax.Array:
    """x: [B, T, F], first: [B, N] -> [B, N, rate, F]: tokens first..first+rate-1 (clipped)."""
    batch, num = first.shape
    idx = jnp.clip(first[:, :, None] + jnp.arange(rate), 0, x.shape[1] - 1).reshape(batch, -1)
    blocks = jnp.take_along_axis(x, idx[:, :, None], axis=1)
    return blocks.reshape(batch, num, rate, x.shape[-1])


def softmax_pool(values: jax.Array, logits: jax.Array) -> jax.Array:
    """values/logits: [B, N, S, c] -> [B, N, c] float32: Σ_s softmax_s(logits) ⊙ values, the
    softmax over the S slots for each channel separately (eqs. 11-12, 22-23)."""
    weights = jax.nn.softmax(logits.astype(jnp.float32), axis=2)
    return jnp.sum(weights * values.astype(jnp.float32), axis=2)


def project_tokens(hidden: jax.Array, params: CompressorParams) -> tuple[jax.Array, jax.Array]:
    """Per-token projections C = H·W^KV (in hidden.dtype) and gate logits Z = H·W^Z (float32,
    before the slot bias): [B, T, d] -> ([B, T, F], [B, T, F]), F = c (HCA) or 2c (CSA)."""
    kv = hidden @ params.kv_proj.astype(hidden.dtype)
    gate = (hidden @ params.gate_proj.astype(hidden.dtype)).astype(jnp.float32)
    return kv, gate


def pool_blocks(values: jax.Array, gates: jax.Array, previous: tuple | None,
                first_position: jax.Array, params: CompressorParams, *, inv_freq: jax.Array,
                eps: float) -> jax.Array:
    """One entry per block from its tokens' projections: values/gates [B, N, m, F] (`project_tokens`
    of the block's m tokens); `previous` (CSA only): (values, gates, has_prev [B, N]) of the
    block before, whose first c channels join the pooling (none for a document's first block);
    first_position [B, N]: of the block's first token (the entry's RoPE position)
    -> [B, N, c] float32: pooled (eqs. 11-12 / 22-23), RMS-normalised, scaled by kv_norm, rotated."""
    width = params.kv_norm.shape[0]
    bias = params.position_bias.astype(jnp.float32)
    logits = gates + bias
    if previous is not None:
        prev_values, prev_gates, has_prev = previous
        has_prev = has_prev[:, :, None, None]
        values = jnp.concatenate(
            [jnp.where(has_prev, prev_values[..., :width], 0), values[..., width:]], axis=2)
        logits = jnp.concatenate(
            [jnp.where(has_prev, prev_gates[..., :width] + bias[:, :width], _NEG),
             logits[..., width:]], axis=2)
    pooled = softmax_pool(values, logits)  # [B, N, c] float32
    normed = pooled * jax.lax.rsqrt(jnp.mean(pooled * pooled, -1, keepdims=True) + eps)
    normed = normed * params.kv_norm.astype(jnp.float32)
    return rotate_trailing_pairs(normed, first_position, inv_freq)


def check_params(params: CompressorParams, rate: int, overlap: bool) -> None:
    """One-line error when the compressor's parameters do not fit rate / overlap."""
    width = params.kv_norm.shape[0]
    expected = (rate, 2 * width if overlap else width)
    if params.position_bias.shape != expected or params.kv_proj.shape[-1] != expected[1]:
        raise ValueError(f"compress_kv: position_bias {params.position_bias.shape} / kv_proj "
                         f"{params.kv_proj.shape} do not fit rate={rate}, c={width}, "
                         f"overlap={overlap}")


def compress_kv(hidden: jax.Array, params: CompressorParams, *, rate: int, overlap: bool,
                inv_freq: jax.Array, segment_ids: jax.Array | None = None,
                positions: jax.Array | None = None, eps: float = 1e-6) -> CompressedKV:
    """hidden: [B, T, d] -> CompressedKV with entries [B, T // rate, c] in hidden.dtype.

    overlap=False: HCA (eqs. 20-23); overlap=True: CSA (eqs. 9-12). inv_freq: [R/2] RoPE
    frequencies of the trailing R channels; segment_ids: [B, T] packed documents (None: one
    document per row); positions: [B, T] the tokens' RoPE positions (None: their offsets in
    their documents), an entry is rotated at its block's first token's; eps: of the entry
    RMSNorm. Blocks are cut by document offsets whatever the positions.
    """
    batch, length, _ = hidden.shape
    check_params(params, rate, overlap)
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, length), jnp.int32)
    kv, gate = project_tokens(hidden, params)  # [B, T, c or 2c]
    offsets = document_offsets(segment_ids)
    return compress_rows(kv, gate, offsets, segment_ids,
                         offsets if positions is None else positions, params, rate=rate,
                         overlap=overlap, inv_freq=inv_freq, eps=eps, slots=length // rate)


def compress_rows(kv: jax.Array, gate: jax.Array, offsets: jax.Array, segment_ids: jax.Array,
                  positions: jax.Array, params: CompressorParams, *, rate: int, overlap: bool,
                  inv_freq: jax.Array, eps: float, slots: int, first_end: int = 0,
                  index_base=0, length: int | None = None) -> CompressedKV:
    """`compress_kv` from the projections (`project_tokens`) kv / gate [B, R, F] of R rows with
    their document offsets, segment ids and RoPE positions [B, R]: the complete blocks whose
    last row is at or after `first_end`, at most `slots` of them. Entries' `last_token` is
    `index_base` ([B] or a scalar: the token index of row 0) plus the row; `length` (default
    R) marks empty slots. A context shard passes its rows with the rows before them in front
    (model/parallel/context_compression.py)."""
    rows = kv.shape[1]
    length = rows if length is None else length
    first = complete_blocks(offsets, rate, slots, first_end)  # [B, slots]
    first_in_row = jnp.minimum(first, rows - 1)  # empty slots read the last row, then zeroed
    block_offset = jnp.take_along_axis(offsets, first_in_row, axis=1)
    block_position = jnp.take_along_axis(positions.astype(jnp.int32), first_in_row, axis=1)
    previous = None
    if overlap:  # a document's first block ("boundary block") has no previous block
        previous = (_gather_blocks(kv, first - rate, rate), _gather_blocks(gate, first - rate, rate),
                    block_offset >= rate)
    entries = pool_blocks(_gather_blocks(kv, first, rate), _gather_blocks(gate, first, rate),
                          previous, block_position, params, inv_freq=inv_freq,
                          eps=eps).astype(kv.dtype)
    empty = first >= rows
    entries = jnp.where(empty[..., None], 0, entries)
    index_base = jnp.reshape(jnp.asarray(index_base, jnp.int32), (-1, 1))
    last_token = jnp.where(empty, length, index_base + first + rate - 1).astype(jnp.int32)
    entry_segments = jnp.take_along_axis(segment_ids, first_in_row, axis=1)
    return CompressedKV(entries, last_token, entry_segments.astype(jnp.int32))
