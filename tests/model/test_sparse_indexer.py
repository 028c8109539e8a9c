"""The CSA lightning indexer (report eqs. 13-17): queries, head weights, index scores, causal and
per-document visibility, chunked top-k selection, and the V3.2-style KL training signal, against
float64 numpy loop references and against transformers' DeepseekV4Indexer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.ops.sparse_indexer import (csa_entry_end_positions, index_scores, indexer_head_weights,
                                     indexer_kl_loss, indexer_queries, select_entries)

RATIO = 4  # CSA compression rate m


# ---- float64 loop references -------------------------------------------------------------------


def np_inv_freq(rope_dims, theta=10000.0):
    return 1.0 / theta ** (np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)


def np_rope_cos_sin(positions, rope_dims, theta=10000.0):
    """[B, T] -> cos, sin [B, T, R/2] of the default (unscaled) RoPE table."""
    angles = positions[..., None].astype(np.float64) * np_inv_freq(rope_dims, theta)
    return np.cos(angles), np.sin(angles)


def np_queries(q_latent, q_b_proj, cos, sin, num_heads):
    """Eq. 14 plus V4's interleaved RoPE on the last R dims, one pair at a time."""
    q = (q_latent.astype(np.float64) @ q_b_proj).reshape(*q_latent.shape[:2], num_heads, -1)
    out = q.copy()
    batch, length, _, dim = q.shape
    half = cos.shape[-1]
    for b in range(batch):
        for t in range(length):
            for h in range(num_heads):
                for i in range(half):
                    a, c = dim - 2 * half + 2 * i, dim - 2 * half + 2 * i + 1
                    out[b, t, h, a] = q[b, t, h, a] * cos[b, t, i] - q[b, t, h, c] * sin[b, t, i]
                    out[b, t, h, c] = q[b, t, h, c] * cos[b, t, i] + q[b, t, h, a] * sin[b, t, i]
    return out


def np_scores(queries, weights, keys):
    """Eq. 16 with explicit loops: Σ_h w_h · max(q_h · k_s, 0) / sqrt(c). -> [B, T, S]."""
    batch, length, num_heads, dim = queries.shape
    out = np.zeros((batch, length, keys.shape[1]))
    for b in range(batch):
        for t in range(length):
            for s in range(keys.shape[1]):
                for h in range(num_heads):
                    dot = float(np.dot(queries[b, t, h].astype(np.float64), keys[b, s]))
                    out[b, t, s] += weights[b, t, h] * max(dot, 0.0) / np.sqrt(dim)
    return out


def np_visible(query_pos, entry_end, query_seg=None, entry_seg=None):
    """Entry s visible from query t: its last token at or before t, same document."""
    batch, length = query_pos.shape
    out = np.zeros((batch, length, entry_end.shape[1]), bool)
    for b in range(batch):
        for t in range(length):
            for s in range(entry_end.shape[1]):
                same_doc = query_seg is None or query_seg[b, t] == entry_seg[b, s]
                out[b, t, s] = entry_end[b, s] <= query_pos[b, t] and same_doc
    return out


def assert_selection_matches(selection, ref_scores, visible, top_k):
    """Top-k set equality modulo ties: per query, as many valid slots as min(k, visible), all
    distinct and visible, whose reference scores are the k largest visible scores."""
    indices, valid, scores = (np.asarray(x) for x in selection)
    assert indices.shape == valid.shape == scores.shape == (*visible.shape[:2], top_k)
    assert indices.dtype == np.int32 and valid.dtype == bool
    for b, t in np.ndindex(*visible.shape[:2]):
        n_visible = int(visible[b, t].sum())
        chosen = indices[b, t][valid[b, t]]
        assert len(chosen) == min(top_k, n_visible), (b, t)
        assert len(set(chosen.tolist())) == len(chosen)
        assert visible[b, t, chosen].all(), f"query {t} selected an entry it cannot see"
        expected = np.sort(ref_scores[b, t][visible[b, t]])[::-1][: len(chosen)]
        np.testing.assert_allclose(
            np.sort(ref_scores[b, t, chosen])[::-1], expected, rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            scores[b, t][valid[b, t]], ref_scores[b, t, chosen], rtol=1e-5, atol=1e-6
        )
        assert np.all(np.isneginf(scores[b, t][~valid[b, t]]))


def _random_inputs(rng, batch=2, length=23, heads=3, dim=8, entries=None):
    entries = entries if entries is not None else length // RATIO
    queries = rng.normal(size=(batch, length, heads, dim)).astype(np.float32)
    weights = rng.normal(size=(batch, length, heads)).astype(np.float32)
    keys = rng.normal(size=(batch, entries, dim)).astype(np.float32)
    return queries, weights, keys


# ---- the pieces --------------------------------------------------------------------------------


def test_queries_and_head_weights_match_reference():
    rng = np.random.default_rng(0)
    batch, length, d_model, d_c, heads, dim, rope = 2, 5, 12, 6, 3, 8, 4
    q_latent = rng.normal(size=(batch, length, d_c)).astype(np.float32)
    q_b_proj = rng.normal(size=(d_c, heads * dim)).astype(np.float32)
    positions = np.tile(np.arange(length) + 3, (batch, 1))
    cos, sin = np_rope_cos_sin(positions, rope)
    got = indexer_queries(
        jnp.asarray(q_latent),
        jnp.asarray(q_b_proj),
        jnp.asarray(positions),
        jnp.asarray(np_inv_freq(rope), jnp.float32),
        num_heads=heads,
    )
    assert got.shape == (batch, length, heads, dim) and got.dtype == jnp.float32
    expected = np_queries(q_latent, q_b_proj.astype(np.float64), cos, sin, heads)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
    assert not np.allclose(
        expected[..., -rope:],
        (q_latent.astype(np.float64) @ q_b_proj).reshape(expected.shape)[..., -rope:],
    ), "RoPE must actually rotate the trailing dims"

    hidden = rng.normal(size=(batch, length, d_model)).astype(np.float32)
    weights_proj = rng.normal(size=(d_model, heads)).astype(np.float32)
    got_w = indexer_head_weights(jnp.asarray(hidden), jnp.asarray(weights_proj))
    expected_w = hidden.astype(np.float64) @ weights_proj / np.sqrt(heads)
    np.testing.assert_allclose(np.asarray(got_w), expected_w, rtol=1e-5, atol=1e-6)


def test_index_scores_match_loop_reference():
    queries, weights, keys = _random_inputs(np.random.default_rng(1), length=7, entries=5)
    got = index_scores(jnp.asarray(queries), jnp.asarray(weights), jnp.asarray(keys))
    np.testing.assert_allclose(
        np.asarray(got), np_scores(queries, weights, keys), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("top_k", [2, 4, 9])  # 9 > S: padded invalid slots everywhere
def test_selection_is_causal_and_matches_reference(top_k):
    rng = np.random.default_rng(2)
    queries, weights, keys = _random_inputs(rng)
    batch, length = queries.shape[:2]
    positions = np.tile(np.arange(length, dtype=np.int32), (batch, 1))
    ends = np.asarray(csa_entry_end_positions(batch, keys.shape[1], RATIO))
    np.testing.assert_array_equal(ends[0], [(s + 1) * RATIO - 1 for s in range(keys.shape[1])])
    selection = select_entries(
        jnp.asarray(queries),
        jnp.asarray(weights),
        jnp.asarray(keys),
        jnp.asarray(positions),
        jnp.asarray(ends),
        top_k=top_k,
        chunk_size=5,
    )
    visible = np_visible(positions, ends)
    assert_selection_matches(selection, np_scores(queries, weights, keys), visible, top_k)
    # never a future token: every token m(s-1) .. m(s+1)-1 that entry s pools is <= t
    for b, t, j in zip(*np.nonzero(np.asarray(selection.valid))):
        assert (int(selection.indices[b, t, j]) + 1) * RATIO - 1 <= t
    # the block that ends at t itself is admitted (upstream's (t + 1) // m rule)
    assert bool(np.asarray(selection.valid)[0, RATIO - 1].any())
    assert not np.asarray(selection.valid)[:, : RATIO - 1].any()


def test_gradients_of_the_chosen_scores_match_loop_reference():
    """d/d(q, w, K) of Σ probe·I over the chosen entries (the selection itself has none):
    dI/dw = ReLU(q·K)/√c, dI/dq = w·[q·K > 0]·K/√c, dI/dK = w·[q·K > 0]·q/√c."""
    rng = np.random.default_rng(7)
    q, w, k = _random_inputs(rng, length=13)
    probe = rng.normal(size=(*q.shape[:2], 2))
    positions = jnp.tile(jnp.arange(q.shape[1], dtype=jnp.int32), (q.shape[0], 1))
    ends = csa_entry_end_positions(q.shape[0], k.shape[1], RATIO)

    def loss(*args):
        selection = select_entries(*args, positions, ends, top_k=2, chunk_size=4)
        return jnp.sum(jnp.where(selection.valid, selection.scores * probe, 0.0)), selection

    (_, selection), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
        jnp.asarray(q), jnp.asarray(w), jnp.asarray(k))
    want = [np.zeros(q.shape), np.zeros(w.shape), np.zeros(k.shape)]
    for b, t, j in zip(*np.nonzero(np.asarray(selection.valid))):
        s, scale = int(selection.indices[b, t, j]), probe[b, t, j] / np.sqrt(q.shape[-1])
        for h in range(q.shape[2]):
            dot = float(np.dot(q[b, t, h].astype(np.float64), k[b, s]))
            want[1][b, t, h] += scale * max(dot, 0.0)
            want[0][b, t, h] += scale * w[b, t, h] * k[b, s] * (dot > 0)
            want[2][b, s] += scale * w[b, t, h] * q[b, t, h] * (dot > 0)
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)


def test_packed_documents_never_select_other_documents():
    rng = np.random.default_rng(3)
    batch, lengths = 2, [(9, 14), (16, 7)]  # two documents per row, per-document positions
    length = 23
    entries_per_doc = [[n // RATIO for n in row] for row in lengths]
    num_entries = max(sum(row) for row in entries_per_doc) + 1  # a padding entry at the end
    queries, weights, keys = _random_inputs(rng, batch, length, entries=num_entries)
    q_pos = np.zeros((batch, length), np.int32)
    q_seg = np.zeros((batch, length), np.int32)
    e_end = np.zeros((batch, num_entries), np.int32)
    e_seg = np.full((batch, num_entries), -1, np.int32)  # padding entries: no query's segment
    for b, row in enumerate(lengths):
        start = entry = 0
        for doc, n in enumerate(row, start=1):
            q_pos[b, start : start + n] = np.arange(n)
            q_seg[b, start : start + n] = doc
            for s in range(n // RATIO):
                e_end[b, entry], e_seg[b, entry] = (s + 1) * RATIO - 1, doc
                entry += 1
            start += n
    selection = select_entries(
        jnp.asarray(queries),
        jnp.asarray(weights),
        jnp.asarray(keys),
        jnp.asarray(q_pos),
        jnp.asarray(e_end),
        top_k=3,
        chunk_size=4,
        query_segment_ids=jnp.asarray(q_seg),
        entry_segment_ids=jnp.asarray(e_seg),
    )
    visible = np_visible(q_pos, e_end, q_seg, e_seg)
    assert_selection_matches(selection, np_scores(queries, weights, keys), visible, 3)
    for b, t, j in zip(*np.nonzero(np.asarray(selection.valid))):
        assert e_seg[b, int(selection.indices[b, t, j])] == q_seg[b, t]
    # without segment ids the second documents would see the first ones' entries
    assert (np_visible(q_pos, e_end) & ~visible).any()


@pytest.mark.parametrize("chunk_size", [1, 4, 5])
def test_chunked_equals_unchunked(chunk_size):
    queries, weights, keys = (jnp.asarray(x) for x in _random_inputs(np.random.default_rng(4)))
    batch, length = queries.shape[:2]
    positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), (batch, 1))
    ends = csa_entry_end_positions(batch, keys.shape[1], RATIO)
    run = jax.jit(select_entries, static_argnames=("top_k", "chunk_size"))
    whole = run(queries, weights, keys, positions, ends, top_k=3, chunk_size=length)
    chunked = run(queries, weights, keys, positions, ends, top_k=3, chunk_size=chunk_size)
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- training signal ---------------------------------------------------------------------------


def np_kl_loss(main_probs, scores, support):
    """Mean over queries with support of KL(p ‖ softmax(I)), p = head-summed, L1-normalised."""
    total, count = 0.0, 0
    for b, t in np.ndindex(*scores.shape[:2]):
        idx = np.nonzero(support[b, t])[0]
        p = main_probs[b, t][:, idx].astype(np.float64).sum(axis=0)
        if len(idx) == 0 or p.sum() == 0:
            continue
        p = p / p.sum()
        logits = scores[b, t, idx].astype(np.float64)
        log_q = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        total += sum(pi * (np.log(pi) - lq) for pi, lq in zip(p, log_q) if pi > 0)
        count += 1
    return total / max(count, 1)


def _kl_inputs(rng, batch=2, length=6, heads=3, entries=5):
    logits = rng.normal(size=(batch, length, heads, entries))
    main_probs = (
        np.exp(logits) / np.exp(logits).sum(-1, keepdims=True) * 0.7
    )  # window/sink take the rest
    main_probs[0, 1, :, 2] = 0.0  # a zero-probability entry inside the support
    scores = rng.normal(size=(batch, length, entries)).astype(np.float32)
    support = rng.random((batch, length, entries)) < 0.7
    support[1, 0] = False  # a query with nothing to select
    return main_probs.astype(np.float32), scores, support


def test_kl_loss_matches_reference():
    main_probs, scores, support = _kl_inputs(np.random.default_rng(5))
    got = indexer_kl_loss(jnp.asarray(main_probs), jnp.asarray(scores), jnp.asarray(support))
    assert got.shape == () and got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), np_kl_loss(main_probs, scores, support), rtol=1e-5)
    # zero when the index scores reproduce the target distribution
    target = np.where(support, main_probs.sum(-2), 0.0)
    matched = np.log(np.maximum(target, 1e-30)).astype(np.float32)
    fine = support & (target > 0)
    assert (
        float(indexer_kl_loss(jnp.asarray(main_probs), jnp.asarray(matched), jnp.asarray(fine)))
        < 1e-5
    )


def test_gradients_reach_indexer_weights_and_not_main_attention():
    """Sparse-stage wiring: indexer params -> Selection.scores -> KL against a main attention
    computed from its own parameters. Only the indexer learns from this loss."""
    rng = np.random.default_rng(6)
    batch, length, d_model, d_c, heads, dim, entries, top_k = 1, 12, 10, 6, 2, 8, 3, 2
    hidden = jnp.asarray(rng.normal(size=(batch, length, d_model)), jnp.float32)
    q_latent = jnp.asarray(rng.normal(size=(batch, length, d_c)), jnp.float32)
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    inv_freq = jnp.asarray(np_inv_freq(4), jnp.float32)
    ends = csa_entry_end_positions(batch, entries, RATIO)
    params = {
        "q_b_proj": jnp.asarray(rng.normal(size=(d_c, heads * dim)), jnp.float32),
        "weights_proj": jnp.asarray(rng.normal(size=(d_model, heads)), jnp.float32),
        "keys": jnp.asarray(
            rng.normal(size=(batch, entries, dim)), jnp.float32
        ),  # indexer compressor output
        "main_logits": jnp.asarray(rng.normal(size=(batch, length, 4, entries)), jnp.float32),
    }

    def loss(p):
        q = indexer_queries(q_latent, p["q_b_proj"], positions, inv_freq, num_heads=heads)
        w = indexer_head_weights(hidden, p["weights_proj"])
        sel = select_entries(q, w, p["keys"], positions, ends, top_k=top_k, chunk_size=5)
        main_probs = jax.nn.softmax(p["main_logits"], axis=-1)  # [B, T, H_main, S]
        picked = jnp.take_along_axis(main_probs, sel.indices[:, :, None, :], axis=-1)
        return indexer_kl_loss(picked, sel.scores, sel.valid)

    value, grads = jax.value_and_grad(loss)(params)
    assert np.isfinite(float(value)) and float(value) > 0
    for name in ("q_b_proj", "weights_proj", "keys"):
        g = np.asarray(grads[name])
        assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, name
    np.testing.assert_array_equal(np.asarray(grads["main_logits"]), 0.0)


# ---- parity with transformers ------------------------------------------------------------------


@pytest.mark.parity
def test_matches_transformers_indexer():
    torch = pytest.importorskip("torch")
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer

    torch.manual_seed(0)
    cfg = DeepseekV4Config(
        hidden_size=24,
        q_lora_rank=12,
        head_dim=32,
        partial_rotary_factor=0.25,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=3,
        num_attention_heads=2,
        compress_rates={"compressed_sparse_attention": RATIO, "heavily_compressed_attention": 8},
    )
    indexer = DeepseekV4Indexer(cfg).eval()
    with torch.no_grad():
        for p in indexer.parameters():
            p.normal_()
    captured = {}
    indexer.scorer.register_forward_hook(
        lambda mod, args, out: captured.update(
            keys=args[1].detach().numpy(), scores=out.detach().numpy()
        )
    )
    batch, length = 2, 22
    hidden = torch.randn(batch, length, cfg.hidden_size)
    q_residual = torch.randn(batch, length, cfg.q_lora_rank)
    position_ids = torch.arange(length)[None].expand(batch, -1)
    with torch.no_grad():
        hf_indices = indexer(hidden, q_residual, position_ids, cache=None, layer_idx=0).numpy()
    rope = cfg.qk_rope_head_dim
    q = indexer_queries(
        jnp.asarray(q_residual.numpy()),
        jnp.asarray(indexer.q_b_proj.weight.detach().numpy().T),
        jnp.asarray(position_ids.numpy()),
        jnp.asarray(np_inv_freq(rope, cfg.rope_parameters["compress"]["rope_theta"]),
                    jnp.float32),
        num_heads=cfg.index_n_heads,
    )
    w = indexer_head_weights(
        jnp.asarray(hidden.numpy()),
        jnp.asarray(indexer.scorer.weights_proj.weight.detach().numpy().T),
    )
    keys = jnp.asarray(captured["keys"])
    np.testing.assert_allclose(
        np.asarray(index_scores(q, w, keys)), captured["scores"], rtol=1e-4, atol=1e-4
    )
    ends = csa_entry_end_positions(batch, keys.shape[1], RATIO)
    sel = select_entries(
        q,
        w,
        keys,
        jnp.asarray(position_ids.numpy(), jnp.int32),
        ends,
        top_k=cfg.index_topk,
        chunk_size=8,
    )
    valid = np.asarray(sel.valid)
    np.testing.assert_array_equal(valid, hf_indices >= 0)
    for b, t in np.ndindex(
        batch, length
    ):  # same chosen sets (the order of equal scores may differ)
        assert set(np.asarray(sel.indices)[b, t][valid[b, t]]) == set(
            hf_indices[b, t][hf_indices[b, t] >= 0]
        )
