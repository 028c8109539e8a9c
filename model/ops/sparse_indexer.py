"""The CSA lightning indexer and its top-k selection (DeepSeek-V4 report §2.3.1, eqs. 13-17),
plus the indexer's training signal (DeepSeek-V3.2's KL recipe). Pure functions in float32.

Pipeline for one CSA layer (shapes: B batch, T queries, S compressed entries, H = n_h^I indexer
heads, c = c^I indexer head dim, R = RoPE dims, k = top-k):

1. keys [B, S, c]: the indexer's *own* overlapped compressor (the CSA compression of eqs. 9-12
   at width c, with its own weights, RMSNorm and RoPE at entry position s·m); not computed here.
2. `indexer_queries`: q^I_t = RoPE(c^Q_t W^{IUQ}) (eq. 14) from the shared query latent c^Q_t
   (eq. 13, already RMS-normalised by the main attention), no per-head norm.
3. `indexer_head_weights`: w^I_t = h_t W^w / sqrt(H) (eq. 15).
4. `select_entries`: I_{t,s} = Σ_h w^I_{t,h} · ReLU(q^I_{t,h} · K_s) / sqrt(c) (eq. 16) over the
   visible entries, then top-k (eq. 17), one query chunk at a time so no [T, S] array is built.
   Where CSA attends densely (the indexer warm-up), `dense_indexer_terms` instead scores every
   visible entry against the dense attention's distribution.

Causality: entry s is visible to query t only when every token it pools is at or before t, i.e.
its last token's position ≤ t (for the unpacked layout, s < (t + 1) // m). The report writes
s < ⌊t/m⌋; the open-source rule is the one above (it admits the block that ends at t itself).
Packed documents: an entry is visible only to queries of its own segment.

Parameter names map onto the Hugging Face checkpoint (`...self_attn.compressor.indexer.*`):
`q_b_proj` = `q_b_proj.weight`.T [d_c, H·c]; `weights_proj` = `scorer.weights_proj.weight`.T
[d, H]. The compressor weights `kv_proj`, `gate_proj` [d, 2c], `position_bias` [m, 2c] and
`kv_norm` [c] belong to step 1.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from model.ops.interleaved_rope import rotate_trailing_pairs
from model.ops.mx_quant import fake_mxfp4, hadamard


class Selection(NamedTuple):
    indices: jax.Array  # [B, T, k] int32 chosen entries (0 where not valid)
    valid: jax.Array  # [B, T, k] bool: a visible entry was chosen in this slot
    scores: (
        jax.Array
    )  # [B, T, k] float32 index scores I_{t,s} of the chosen entries (-inf if not valid)


def indexer_queries(
    q_latent: jax.Array,
    q_b_proj: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array,
    *,
    num_heads: int,
) -> jax.Array:
    """Indexer queries q^I_t (eq. 14), rotated at the query positions.

    q_latent: [B, T, d_c] (c^Q_t of eq. 13, after the main attention's q_a_norm);
    q_b_proj: [d_c, H·c]; positions: [B, T]; inv_freq: [R/2] of the compressed layers' RoPE
    (the frequencies the indexer keys were rotated with, so q·k depends on distance only).
    Returns [B, T, H, c] in q_latent's dtype.
    """
    batch, length, _ = q_latent.shape
    q = jnp.einsum("btr,rf->btf", q_latent, q_b_proj.astype(q_latent.dtype))
    return rotate_trailing_pairs(q.reshape(batch, length, num_heads, -1), positions, inv_freq)


def indexer_head_weights(hidden: jax.Array, weights_proj: jax.Array) -> jax.Array:
    """Per-head weights w^I_t (eq. 15), scaled by 1/sqrt(H) as upstream does.

    hidden: [B, T, d] (h_t, the attention input); weights_proj: [d, H]. Returns [B, T, H] float32.
    """
    weights = jnp.einsum("btd,dh->bth", hidden, weights_proj.astype(hidden.dtype))
    return weights.astype(jnp.float32) * weights_proj.shape[-1] ** -0.5


def fp4_qk(x: jax.Array) -> jax.Array:
    """FP4 QAT of the indexer's queries or keys [..., c] (report §3.4): Hadamard-rotated (as the
    release rotates them; q·k is unchanged) and through MXFP4, gradient straight through."""
    return fake_mxfp4(x.astype(jnp.float32) @ hadamard(x.shape[-1]))


def index_scores(queries: jax.Array, head_weights: jax.Array, keys: jax.Array,
                 score_dtype=jnp.float32) -> jax.Array:
    """Eq. 16 without masking: I_{t,s} = Σ_h w_{t,h} · ReLU(q_{t,h} · K_s) / sqrt(c), rounded
    to `score_dtype` (bfloat16 under QAT, report §3.4).

    queries: [B, C, H, c]; head_weights: [B, C, H]; keys: [B, S, c]. Returns [B, C, S] float32.
    """
    logits = jnp.einsum("bthc,bsc->bths", queries.astype(jnp.float32), keys.astype(jnp.float32))
    scaled = jax.nn.relu(logits) * queries.shape[-1] ** -0.5
    scores = jnp.einsum("bths,bth->bts", scaled, head_weights.astype(jnp.float32))
    return scores.astype(score_dtype).astype(jnp.float32)


def csa_entry_end_positions(batch: int, num_entries: int, ratio: int) -> jax.Array:
    """Position of the last token pooled by each entry of one unpacked sequence: entry s pools
    tokens up to m(s+1) - 1 (eq. 12; its overlap half reaches back, never forward).
    Returns [B, S] int32."""
    ends = (jnp.arange(num_entries, dtype=jnp.int32) + 1) * ratio - 1
    return jnp.broadcast_to(ends, (batch, num_entries))


def visible_entries(
    query_positions: jax.Array,
    entry_end_positions: jax.Array,
    query_segment_ids: jax.Array | None = None,
    entry_segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Which entries each query may score: all of the entry's tokens at or before the query,
    same document. Positions are in one coordinate system (per-document positions for packed
    rows). Give padding entries a segment id no query has.

    query_positions: [B, C]; entry_end_positions: [B, S]; segment ids: [B, C] / [B, S] or None.
    Returns bool [B, C, S].
    """
    visible = entry_end_positions[:, None, :] <= query_positions[:, :, None]
    if query_segment_ids is not None:
        visible &= entry_segment_ids[:, None, :] == query_segment_ids[:, :, None]
    return visible


def _choose_in_chunk(queries, head_weights, keys, visible, top_k: int, score_dtype):
    """Top-k of one query chunk's masked scores -> (indices [B, C, k] int32, 0 where not valid;
    valid [B, C, k]). Fewer visible entries than k leave invalid slots."""
    scores = jnp.where(visible, index_scores(queries, head_weights, keys, score_dtype), -jnp.inf)
    _, indices = jax.lax.top_k(scores, min(top_k, scores.shape[-1]))
    valid = jnp.take_along_axis(visible, indices, axis=-1)
    pad = ((0, 0), (0, 0), (0, top_k - indices.shape[-1]))
    return jnp.pad(jnp.where(valid, indices, 0), pad).astype(jnp.int32), jnp.pad(valid, pad)


def _chosen_scores(queries, head_weights, keys, indices, valid, score_dtype) -> jax.Array:
    """Eq. 16 at the chosen entries only: [B, C, k] float32, -inf where not valid."""
    chosen = jnp.take_along_axis(keys[:, None], indices[..., None], axis=2)  # [B, C, k, c]
    logits = jnp.einsum("bqkc,bqhc->bqkh", chosen.astype(jnp.float32),
                        queries.astype(jnp.float32))
    scaled = jax.nn.relu(logits) * queries.shape[-1] ** -0.5
    scores = jnp.einsum("bqkh,bqh->bqk", scaled, head_weights.astype(jnp.float32))
    return jnp.where(valid, scores.astype(score_dtype).astype(jnp.float32), -jnp.inf)


def _query_chunks(x: jax.Array, chunk_size: int, fill=0) -> jax.Array:
    """[B, T, ...] -> [num_chunks, B, chunk_size, ...], the last chunk padded with `fill`."""
    batch, length = x.shape[:2]
    num_chunks = -(-length // chunk_size)
    x = jnp.pad(x, [(0, 0), (0, num_chunks * chunk_size - length)] + [(0, 0)] * (x.ndim - 2),
                constant_values=fill)
    return jnp.moveaxis(x.reshape(batch, num_chunks, chunk_size, *x.shape[2:]), 1, 0)


def select_entries(
    queries: jax.Array,
    head_weights: jax.Array,
    keys: jax.Array,
    query_positions: jax.Array,
    entry_end_positions: jax.Array,
    *,
    top_k: int,
    chunk_size: int,
    query_segment_ids: jax.Array | None = None,
    entry_segment_ids: jax.Array | None = None,
    score_dtype=jnp.float32,
) -> Selection:
    """Top-k compressed entries per query (eqs. 16-17), `chunk_size` queries at a time (peak
    score memory [B, chunk_size, H, S] instead of [B, T, H, S]). The choice is discrete, so
    the chunks' [chunk_size, S] scores and top-k run without gradient; the chosen entries'
    scores are then recomputed from their gathered keys, and only that O(T·k) part is
    differentiated (rematerialised per chunk).

    queries: [B, T, H, c]; head_weights: [B, T, H]; keys: [B, S, c]; query_positions: [B, T];
    entry_end_positions: [B, S]; segment ids: [B, T] / [B, S] or None (one document per row);
    score_dtype: the index scores' precision (`index_scores`). Returns a Selection of
    [B, T, top_k] arrays. Slots with no visible entry left (early queries, short documents) are
    invalid. The scores of valid slots carry gradients into the indexer.
    """
    batch, length = query_positions.shape
    padded = -(-length // chunk_size) * chunk_size

    chunked = functools.partial(_query_chunks, chunk_size=chunk_size)  # `unchunked` drops padding

    placement = (query_positions,) if query_segment_ids is None else (query_positions,
                                                                        query_segment_ids)

    def choose(xs):
        q, w, pos, *seg = jax.lax.stop_gradient(xs)
        visible = visible_entries(
            pos, entry_end_positions, seg[0] if seg else None, entry_segment_ids
        )
        return _choose_in_chunk(q, w, jax.lax.stop_gradient(keys), visible, top_k, score_dtype)

    def score(xs):
        q, w, indices, valid = xs
        return _chosen_scores(q, w, keys, indices, valid, score_dtype)

    q_chunks, w_chunks = chunked(queries), chunked(head_weights)
    indices, valid = jax.lax.map(choose, (q_chunks, w_chunks, *map(chunked, placement)))
    # Rematerialised per chunk (as the core attention's chunks): the backward keeps only the
    # [B, T, k] selection, not every chunk's [chunk, k, c] gathered keys.
    scores = jax.lax.map(jax.checkpoint(score), (q_chunks, w_chunks, indices, valid))

    def unchunked(x):
        """[num_chunks, B, chunk_size, k] -> [B, T, k]."""
        return jnp.moveaxis(x, 0, 1).reshape(batch, padded, top_k)[:, :length]

    return Selection(unchunked(indices), unchunked(valid), unchunked(scores))


def _kl_per_query(target: jax.Array, scores: jax.Array, support: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """KL(p_t ‖ softmax(I_t)) per query over its support: target p (unnormalised, no gradient)
    [..., N], scores I [..., N], support bool [..., N] -> (KL [...], has_support [...])."""
    target = jnp.where(support, target.astype(jnp.float32), 0.0)
    mass = jnp.sum(target, axis=-1, keepdims=True)
    target = target / jnp.where(mass > 0, mass, 1.0)
    has_support = jnp.any(support, axis=-1) & (mass[..., 0] > 0)
    # rows without support get finite logits: their term is dropped, and log_softmax of an
    # all -inf row would turn the whole gradient into NaN
    logits = jnp.where(support, scores.astype(jnp.float32), -jnp.inf)
    log_q = jax.nn.log_softmax(jnp.where(has_support[..., None], logits, 0.0), axis=-1)
    # 0·log 0 = 0: entries outside the support or without target mass contribute nothing
    terms = jnp.where(
        target > 0, target * (jnp.log(jnp.where(target > 0, target, 1.0)) - log_q), 0.0
    )
    return jnp.where(has_support, jnp.sum(terms, axis=-1), 0.0), has_support


def indexer_kl_loss(main_probs: jax.Array, scores: jax.Array, support: jax.Array) -> jax.Array:
    """The indexer's training signal (DeepSeek-V3.2 report, continued pre-training: "dense
    warm-up" and "sparse training" stages; the V4 report names only an indexer warm-up stage
    and the open-source code has no loss): KL(p_t ‖ softmax(I_t)) averaged over the queries
    with a non-empty support, where p_t is the main attention's probability over the entries
    summed over heads and L1-normalised.

    The main attention is a stop-gradient target: this loss trains only the indexer (V3.2 also
    detaches the indexer's inputs; callers do that with stop_gradient on h and c^Q).
    Sparse stage: N = k over the selected entries (Selection.scores / .valid), the main
    attention's probabilities gathered likewise; the dense warm-up is `dense_indexer_terms`.

    main_probs: [B, T, H, N]; scores: [B, T, N] (I_{t,s}); support: bool [B, T, N].
    Returns a float32 scalar.
    """
    per_query, has_support = _kl_per_query(
        jnp.sum(jax.lax.stop_gradient(main_probs), axis=-2), scores, support)
    return jnp.sum(per_query) / jnp.maximum(jnp.sum(has_support), 1)


class DenseIndexerTerms(NamedTuple):
    """Where CSA attends densely (every visible entry, no top-k): the indexer's warm-up loss and
    how well its top-k would have matched the dense attention."""

    loss: jax.Array  # float32 []: KL(p_t ‖ softmax(I_t)) over every visible entry, query mean
    recall_hits: jax.Array  # float32 []: indexer top-k entries that are in the attention's top-k
    recall_slots: jax.Array  # float32 []: Σ_t k over the queries that see more than k entries

    @classmethod
    def from_sums(cls, kl, count, hits, slots) -> "DenseIndexerTerms":
        """From `dense_indexer_sums`' sums (over all the queries): the KL's query mean."""
        return cls(kl / jnp.maximum(count, 1.0), hits, slots)


def topk_recall(scores: jax.Array, target: jax.Array, visible: jax.Array, top_k: int
                ) -> tuple[jax.Array, jax.Array]:
    """How many of each query's top-k entries by `scores` are among its top-k by `target` (both
    over its visible entries), summed over the queries that see more than k entries (the others
    attend to all of theirs whatever the scores): scores, target [B, C, S], visible bool
    [B, C, S] -> (hits, slots) float32 scalars; recall = hits / slots."""
    k = min(top_k, scores.shape[-1])
    picked = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), k)[1]
    best = jax.lax.top_k(jnp.where(visible, target, -jnp.inf), k)[1]
    counted = jnp.sum(visible, axis=-1) > top_k  # [B, C]
    in_best = jnp.zeros(visible.shape, bool)
    in_best = jax.vmap(jax.vmap(lambda row, idx: row.at[idx].set(True)))(in_best, best)
    hits = jnp.sum(jnp.take_along_axis(in_best, picked, axis=-1), axis=-1)  # [B, C]
    return (jnp.sum(jnp.where(counted, hits, 0)).astype(jnp.float32),
            (jnp.sum(counted) * k).astype(jnp.float32))


def dense_indexer_terms(
    queries: jax.Array,
    head_weights: jax.Array,
    keys: jax.Array,
    target: jax.Array,
    query_positions: jax.Array,
    entry_end_positions: jax.Array,
    *,
    top_k: int,
    chunk_size: int,
    query_segment_ids: jax.Array | None = None,
    entry_segment_ids: jax.Array | None = None,
    score_dtype=jnp.float32,
) -> DenseIndexerTerms:
    """The indexer's warm-up signal (DeepSeek-V3.2's dense warm-up): KL from the main attention's
    distribution over *every* visible compressed entry, so entries the indexer would never pick
    get a signal too, plus its top-k recall against that distribution. `chunk_size` queries at
    a time (peak [B, chunk, H, S] scores), each chunk rematerialised in the backward.

    queries [B, T, H, c], head_weights [B, T, H], keys [B, S, c]: the indexer's (with gradient);
    target [B, T, S]: the main attention's probability of each entry summed over heads (no
    gradient); positions / segment ids and `score_dtype` as in `select_entries`.
    """
    return DenseIndexerTerms.from_sums(*dense_indexer_sums(
        queries, head_weights, keys, target, query_positions, entry_end_positions, top_k=top_k,
        chunk_size=chunk_size, query_segment_ids=query_segment_ids,
        entry_segment_ids=entry_segment_ids, score_dtype=score_dtype))


def dense_indexer_sums(queries, head_weights, keys, target, query_positions, entry_end_positions,
                       *, top_k: int, chunk_size: int, query_segment_ids=None,
                       entry_segment_ids=None, score_dtype=jnp.float32):
    """`dense_indexer_terms` before the mean: (Σ_t KL_t, queries with support, recall hits,
    recall slots), float32 scalars that add up over pieces of the queries."""
    chunked = functools.partial(_query_chunks, chunk_size=chunk_size)
    segments = () if query_segment_ids is None else (chunked(query_segment_ids),)
    target = jax.lax.stop_gradient(target)

    def one_chunk(xs):
        q, w, p, pos, *seg = xs
        visible = visible_entries(pos, entry_end_positions, seg[0] if seg else None,
                                  entry_segment_ids)
        scores = index_scores(q, w, keys, score_dtype)
        kl, has_support = _kl_per_query(p, scores, visible)
        hits, slots = topk_recall(jax.lax.stop_gradient(scores), p, visible, top_k)
        return jnp.sum(kl), jnp.sum(has_support).astype(jnp.float32), hits, slots

    # Padding queries sit at position -1: no entry ends before them, so they carry no term.
    kl, count, hits, slots = jax.lax.map(jax.checkpoint(one_chunk), (
        chunked(queries), chunked(head_weights), chunked(target),
        chunked(query_positions, fill=-1), *segments))
    return jnp.sum(kl), jnp.sum(count), jnp.sum(hits), jnp.sum(slots)
