"""DeepSeek-V4's attention layer (model/layers/shared_kv_attention.py) against a float64 loop
reference of report §2.3: low-rank query with its norm, per-head query norm, KV-entry norm,
interleaved partial RoPE on the trailing dims, window + compressed entries + sink, the inverse
rotation of the output at the query position, and the grouped low-rank output projection; on
packed rows (two documents) so compression and the window restart at the boundary."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from model.config import config_from_dict
from model.layers.shared_kv_attention import SharedKVAttention
from tests.train_helpers import FAST_COMPILE
from tests.compression_references import (
    reference_attention,
    reference_compress,
    rope_interleaved,
)

EPS = 1e-6


def tiny_config(layout="WH"):
    return config_from_dict(dict(
        vocab_size=32, d_model=24, num_layers=len(layout), layout=layout, window=5,
        num_dense_layers=0, norm_eps=EPS,
        shared_kv_attention=dict(num_heads=4, head_dim=12, rope_dims=4, q_lora_rank=16,
                                 o_groups=2, o_lora_rank=6, rope_theta=100.0,
                                 compress_rope_theta=1000.0, csa_rate=2, hca_rate=3,
                                 index_heads=2, index_head_dim=8, index_topk=2,
                                 query_chunk=8),
        moe=dict(num_experts=4, top_k=2, expert_hidden=8, shared_hidden=8, num_ep_groups=1),
        mtp=dict(num_heads=0)))


def random_params(layer, key, *inputs):
    """The layer's params, every leaf random (the zero-initialised norms, sinks and slot biases
    included); only their shapes come from `init` (traced, not run)."""
    shapes = jax.eval_shape(layer.init, jax.random.key(1), *inputs)
    return randomised(nn.meta.unbox(shapes)["params"], key)


def randomised(params, key):
    """Every leaf random (the zero-initialised norms, sinks and slot biases included)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [0.3 * jax.random.normal(k, x.shape, x.dtype)
                                     for k, x in zip(keys, leaves)])


def rms64(x, eps=EPS):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def inv_freq64(rope_dims, theta):
    return 1.0 / theta ** (np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)


def document_positions(segments):
    """Per-document offsets of a packed [B, T] segment array (the model's default positions)."""
    positions = np.zeros(np.shape(segments), int)
    for b, row in enumerate(segments):
        for t in range(1, len(row)):
            positions[b, t] = positions[b, t - 1] + 1 if row[t] == row[t - 1] else 0
    return positions


def reference_indexer(p, cfg, x, latent, positions, segments, freqs):
    """Eqs. 13-17 in float64 loops: per row and query, the index score of every visible entry of
    the indexer's own overlapped compressor, {slot: I_{t,s}}."""
    attn = cfg.shared_kv_attention
    c = p["compressor"]
    keys = reference_compress(x, c["kv_proj"], c["gate_proj"], c["position_bias"],
                              1 + c["kv_norm"], attn.csa_rate, True, freqs, segments, eps=EPS,
                              positions=positions)
    heads, dim = attn.index_heads, attn.index_head_dim
    scores = []
    for b in range(x.shape[0]):
        rows = []
        for t in range(x.shape[1]):
            q = (latent[b, t] @ p["q_b_proj"]).reshape(heads, dim)
            q = [rope_interleaved(q[h], positions[b, t], freqs) for h in range(heads)]
            w = x[b, t] @ p["weights_proj"] / np.sqrt(heads)
            rows.append({s: sum(w[h] * max(float(np.dot(q[h], vec)), 0.0) / np.sqrt(dim)
                                for h in range(heads))
                         for s, (vec, last, seg) in enumerate(keys[b])
                         if last <= t and seg == segments[b][t]})
        scores.append(rows)
    return scores


def reference_kl(probs, scores):
    """KL(p ‖ softmax(I)) over the entries of `scores` ({slot: I}), p the attention's
    probabilities of those entries L1-normalised; None without support."""
    if not scores or sum(probs.get(s, 0.0) for s in scores) == 0:
        return None
    mass = sum(probs.get(s, 0.0) for s in scores)
    top = max(scores.values())
    log_z = top + np.log(sum(np.exp(v - top) for v in scores.values()))
    return sum(probs[s] / mass * (np.log(probs[s] / mass) - (scores[s] - log_z))
               for s in scores if probs.get(s, 0.0) > 0)


def reference_layer(p, cfg, x, segments, attention_type, positions=None):
    """Explicit float64 evaluation of the layer on x [B, T, d] with packed `segments` and RoPE
    `positions` [B, T] (None: per-document offsets) -> (output [B, T, d], aux: for a C layer
    the indexer loss, and where it attends densely the recall hits and slots)."""
    attn = cfg.shared_kv_attention
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    x = np.asarray(x, np.float64)
    batch, length, _ = x.shape
    theta = attn.rope_theta if attention_type == "W" else attn.compress_rope_theta
    freqs = inv_freq64(attn.rope_dims, theta)
    heads, dim = attn.num_heads, attn.head_dim
    positions = document_positions(segments) if positions is None else np.asarray(positions)
    q = np.zeros((batch, length, heads, dim))
    kv = np.zeros((batch, length, dim))
    latent = np.zeros((batch, length, attn.q_lora_rank))
    for b in range(batch):
        for t in range(length):
            latent[b, t] = rms64(x[b, t] @ p["q_a_proj"]["kernel"]) * (1 + p["q_a_norm"]["weight"])
            heads_q = np.einsum("r,rhd->hd", latent[b, t], p["q_b_proj"]["kernel"])
            for h in range(heads):
                q[b, t, h] = rope_interleaved(rms64(heads_q[h]), positions[b, t], freqs)
            entry = rms64(x[b, t] @ p["kv_proj"]["kernel"]) * (1 + p["kv_norm"]["weight"])
            kv[b, t] = rope_interleaved(entry, positions[b, t], freqs)
    aux = {}
    if attention_type == "W":
        entries = [[] for _ in range(batch)]
    else:
        c = p["compressor"]
        rate = attn.csa_rate if attention_type == "C" else attn.hca_rate
        entries = reference_compress(x, c["kv_proj"], c["gate_proj"], c["position_bias"],
                                     1 + c["kv_norm"], rate, attention_type == "C", freqs,
                                     segments, eps=EPS, positions=positions)
    if attention_type == "C":
        scores = reference_indexer(p["indexer"], cfg, x, latent, positions, segments, freqs)
        top_k = attn.index_topk
        ranked = [[sorted(row, key=row.get, reverse=True) for row in rows] for rows in scores]
        dense = attn.csa_attention == "dense"
        selected = None if dense else np.array(
            [[(r + [-1] * top_k)[:top_k] for r in rows] for rows in ranked])
        o, probs = reference_attention(q, kv, entries, p["sinks"], cfg.window, segments,
                                       selected, entry_probs=True)
        supports = {(b, t): scores[b][t] if dense else
                    {s: scores[b][t][s] for s in ranked[b][t][:top_k]}
                    for b, t in np.ndindex(batch, length)}
        kls = [reference_kl(probs[b][t], support) for (b, t), support in supports.items()]
        aux["indexer_loss"] = np.mean([kl for kl in kls if kl is not None])
        if dense:  # queries that see more than k entries: indexer top-k among attention top-k
            crowded = [(b, t) for b, t in np.ndindex(batch, length) if len(scores[b][t]) > top_k]
            best = {(b, t): sorted(probs[b][t], key=probs[b][t].get, reverse=True)[:top_k]
                    for b, t in crowded}
            aux["indexer_recall_hits"] = sum(len(set(ranked[b][t][:top_k]) & set(best[b, t]))
                                             for b, t in crowded)
            aux["indexer_recall_slots"] = top_k * len(crowded)
    else:
        o = reference_attention(q, kv, entries, p["sinks"], cfg.window, segments)
    out = np.zeros((batch, length, cfg.d_model))
    per_group = heads // attn.o_groups
    for b in range(batch):
        for t in range(length):
            heads_o = [rope_interleaved(o[b, t, h], -positions[b, t], freqs)
                       for h in range(heads)]
            mixed = []
            for g in range(attn.o_groups):
                group_in = np.concatenate(heads_o[g * per_group:(g + 1) * per_group])
                mixed.append(group_in @ p["o_a_proj"][g])
            out[b, t] = np.einsum("gr,grd->d", np.stack(mixed), p["o_b_proj"]["kernel"])
    return out, aux


@pytest.mark.parametrize("attention_type", ["W", "H"])
def test_layer_matches_float64_loop_reference(attention_type):
    cfg = tiny_config()
    layer = SharedKVAttention(cfg, attention_type)
    x = jax.random.normal(jax.random.key(0), (2, 14, cfg.d_model))
    segments = np.array([[0] * 8 + [1] * 6, [0] * 14], np.int32)
    from model.ops.kv_compression import document_offsets
    positions = document_offsets(jnp.asarray(segments))
    params = random_params(layer, jax.random.key(2), x, positions, segments)
    got, aux = jax.jit(layer.apply, compiler_options=FAST_COMPILE)(
        {"params": params}, x, positions, jnp.asarray(segments))
    want, _ = reference_layer(params, cfg, x, segments, attention_type)
    assert aux == {}
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("csa_attention", ["sparse", "dense"])
def test_csa_layer_end_to_end_matches_float64_loop_reference(csa_attention):
    """A C layer (indexer, top-k or every visible entry, window, sink, inverse rotation, grouped
    output) and its indexer loss (and, dense, its recall) against the float64 loops, on packed
    rows at caller positions that are not the per-document offsets: compressed entries and
    indexer keys are rotated at their block's first position as the caller numbers it."""
    cfg = tiny_config("C")
    cfg = cfg.replace(shared_kv_attention=dataclasses.replace(cfg.shared_kv_attention,
                                                              csa_attention=csa_attention))
    layer = SharedKVAttention(cfg, "C")
    x = jax.random.normal(jax.random.key(3), (2, 14, cfg.d_model))
    segments = np.array([[0] * 8 + [1] * 6, [0] * 14], np.int32)
    positions = document_positions(segments) + np.array([[7], [100]])
    params = random_params(layer, jax.random.key(4), x, jnp.asarray(positions),
                           jnp.asarray(segments))
    got, aux = jax.jit(layer.apply, compiler_options=FAST_COMPILE)(
        {"params": params}, x, jnp.asarray(positions), jnp.asarray(segments))
    want, want_aux = reference_layer(params, cfg, x, segments, "C", positions)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
    assert set(aux) == set(want_aux)
    np.testing.assert_allclose(float(aux["indexer_loss"]), want_aux["indexer_loss"], rtol=1e-4)
    if csa_attention == "dense":
        assert want_aux["indexer_recall_slots"] > 0
        for key in ("indexer_recall_hits", "indexer_recall_slots"):
            assert float(aux[key]) == want_aux[key], key


@pytest.mark.slow
def test_csa_layer_reports_indexer_loss_and_trains_indexer_only_through_it():
    """The indexer's inputs are detached (V3.2's recipe): the LM path gives its params no
    gradient, its KL loss gives them one and the rest of the layer none."""
    cfg = tiny_config("C")
    layer = SharedKVAttention(cfg, "C")
    x = jax.random.normal(jax.random.key(0), (1, 12, cfg.d_model))
    positions = jnp.arange(12)[None]
    params = random_params(layer, jax.random.key(2), x, positions, None)

    def grads(which):
        def loss(p):
            y, aux = layer.apply({"params": p}, x, positions, None)
            return jnp.sum(y * y) if which == "output" else aux["indexer_loss"]
        return jax.jit(jax.grad(loss), compiler_options=FAST_COMPILE)(params)

    def norms(tree):
        return {k: float(sum(jnp.sum(jnp.abs(v)) for v in jax.tree.leaves(sub)))
                for k, sub in tree.items()}

    from_output, from_indexer = norms(grads("output")), norms(grads("indexer"))
    assert from_output["indexer"] == 0.0
    assert all(v > 0 for k, v in from_output.items() if k != "indexer")
    assert from_indexer["indexer"] > 0
    assert all(v == 0.0 for k, v in from_indexer.items() if k != "indexer")



@pytest.mark.slow
def test_indexer_learns_the_dense_attention_in_a_short_warm_up():
    """The warm-up signal (dense CSA: the KL from the attention over every visible entry)
    trains a freshly initialised indexer, alone and on fresh random inputs each step, towards
    the attention it stands in for: its top-k recall against the dense attention's top-k, on
    inputs it never saw, rises from chance (measured 0.33 -> 0.53-0.61 after 300 Adam steps,
    over four data seeds; the steps are one scan, ~0.3 s after compiling). The rest of the
    layer is random and fixed."""
    attn = dataclasses.replace(tiny_config("C").shared_kv_attention, csa_attention="dense",
                               index_topk=4, index_heads=4, index_head_dim=12)
    cfg = tiny_config("C").replace(shared_kv_attention=attn)
    layer = SharedKVAttention(cfg, "C")
    shape = (4, 48, cfg.d_model)
    positions = jnp.broadcast_to(jnp.arange(shape[1]), shape[:2])
    params = nn.meta.unbox(jax.jit(layer.init, compiler_options=FAST_COMPILE)(
        jax.random.key(1), jnp.zeros(shape), positions, None))["params"]
    main = randomised({k: v for k, v in params.items() if k != "indexer"}, jax.random.key(2))

    def aux(indexer, x):
        return layer.apply({"params": {**main, "indexer": indexer}}, x, positions, None)[1]

    def recall(indexer, x):
        terms = aux(indexer, x)
        return terms["indexer_recall_hits"] / terms["indexer_recall_slots"]

    optimizer = optax.adam(1e-2)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def warm_up(indexer):
        def step(carry, key):
            indexer, state = carry
            loss, grads = jax.value_and_grad(lambda p: aux(p, jax.random.normal(key, shape))[
                "indexer_loss"])(indexer)
            updates, state = optimizer.update(grads, state)
            return (optax.apply_updates(indexer, updates), state), loss
        keys = jax.random.split(jax.random.key(100), 300)
        (indexer, _), losses = jax.lax.scan(step, (indexer, optimizer.init(indexer)), keys)
        return indexer, losses

    held_out = jax.random.normal(jax.random.key(9), shape)
    recall = jax.jit(recall, compiler_options=FAST_COMPILE)
    before = float(recall(params["indexer"], held_out))
    trained, losses = warm_up(params["indexer"])
    after = float(recall(trained, held_out))
    assert after > before + 0.15, (before, after)
    assert float(jnp.mean(losses[-20:])) < 0.9 * float(jnp.mean(losses[:20])), losses
