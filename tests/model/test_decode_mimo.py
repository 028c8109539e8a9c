"""KV-cache decoding of MiMo-V2-Flash models (configs/tiny_mimo.yaml at test sizes):
per-type geometry (1 KV head on full layers, 2 on SWA; Q/K heads of 24 dims, values of 16),
partial RoPE, value_scale, the sink on SWA layers only (and on the MTP heads' SWA blocks),
group-limited routing, checked against the training-path full forward pass of CausalLM: logits
of every position (main and MTP) with chunked prefill and rows of different lengths, rolled-back
drafts, greedy generation and greedy speculative decoding."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from routing_checks import check_recorded_routes, model_forward
from train_helpers import REPO

from model.config import load_config
from model.inference.cache_memory import cache_bytes
from model.inference.decode import Decoder
from model.inference.kv_cache import KVCacheSpec
from model.lm import CausalLM, init_variables

# Window 8 (ring of 8 + 2 draft slots) with rows of 30 and 13 tokens: row 0's rings wrap around
# three times. int(0.334 * 24) = 8 rotary dims.
CFG = load_config(REPO / "configs" / "tiny_mimo.yaml", [
    "vocab_size=64", "d_model=32", "init_std=0.2", "window=8", "head_dim=24", "v_head_dim=16",
    "full_attention.num_heads=4", "swa_attention.num_heads=4", "dense_hidden=64",
    "moe.num_experts=8", "moe.top_k=2", "moe.expert_hidden=16", "moe.num_ep_groups=2",
    "moe.num_groups=4", "moe.topk_groups=2", "mtp.num_heads=2"])
MAX_LEN, DRAFT, CHUNK = 40, 2, 3
SEQUENCES = [np.random.default_rng(0).integers(0, 64, 30),
             np.random.default_rng(1).integers(0, 64, 13)]
TOL = dict(rtol=1e-5, atol=1e-5)


def random_sinks_and_biases(variables):
    """Sinks (0 at init) and router biases (0 at init) set to random values of scale 1 / 0.3,
    so that the caches have to get them right."""
    rng = np.random.default_rng(2)

    def perturb(path, leaf):
        name = getattr(path[-1], "key", "")
        if name == "sink":
            return jnp.asarray(rng.normal(size=leaf.shape), leaf.dtype)
        if name == "router_bias":
            return jnp.asarray(rng.normal(scale=0.3, size=leaf.shape), leaf.dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(perturb, variables)


VARIABLES = random_sinks_and_biases(nn.meta.unbox(init_variables(CausalLM(CFG), jax.random.key(1))))


def test_config_covers_the_mimo_features():
    full, swa = CFG.attention_geometry("F"), CFG.attention_geometry("S")
    assert CFG.layout == "FSSSSF" and CFG.mtp.attention_type == "S"
    assert (full.num_kv_heads, swa.num_kv_heads, full.v_head_dim, full.head_dim) == (1, 2, 16, 24)
    assert (full.gate, swa.gate, full.rotary_dims, CFG.value_scale) == ("none", "sink", 8, 0.707)
    assert CFG.moe.num_shared_experts == 0 and CFG.moe.topk_groups < CFG.moe.num_groups
    assert CFG.window + DRAFT < len(SEQUENCES[0]) // 2


_full_forward = model_forward(CFG, VARIABLES)  # (tokens, routes=None): tests/routing_checks.py


def full_forward(rows):
    """Training-path logits of rows padded with 0 to MAX_LEN (causal: a position's logits do
    not depend on later tokens): main [B, MAX_LEN, V], MTP head h [B, MAX_LEN, V]."""
    tokens = np.zeros((len(rows), MAX_LEN), np.int32)
    for b, row in enumerate(rows):
        tokens[b, :len(row)] = row
    logits, mtp_logits, _, _ = _full_forward(jnp.asarray(tokens))
    return np.asarray(logits), [np.asarray(m) for m in mtp_logits], tokens


CACHED = CausalLM(CFG, KVCacheSpec(MAX_LEN, DRAFT))


@jax.jit
def _backbone(cache, tokens, positions):
    (normed, h, _), mutated = CACHED.apply({**VARIABLES, "cache": cache}, tokens, positions,
                                           method=CausalLM.decode_chunk, mutable=["cache"])
    return CACHED.apply(VARIABLES, normed, method=CausalLM.project), h, mutated["cache"]


@functools.partial(jax.jit, static_argnums=1)
def _mtp(cache, head, h_prev, tokens, positions):
    (normed, h), mutated = CACHED.apply({**VARIABLES, "cache": cache}, head, h_prev, tokens,
                                        positions, method=CausalLM.mtp_chunk, mutable=["cache"])
    return CACHED.apply(VARIABLES, normed, head, method=CausalLM.project), h, mutated["cache"]


@functools.lru_cache(maxsize=1)
def decoder():
    return Decoder(CFG, VARIABLES, max_len=MAX_LEN, draft=DRAFT, prefill_chunk=CHUNK)


def chunk_of(tokens, spans, width=CHUNK):
    """Tokens, positions [B, width] of positions start..start+n-1 per row for spans
    [(start, n)]; -1 elsewhere (padding)."""
    chunk = np.zeros((len(spans), width), np.int32)
    positions = np.full((len(spans), width), -1, np.int32)
    for b, (start, n) in enumerate(spans):
        chunk[b, :n] = tokens[b, start:start + n]
        positions[b, :n] = np.arange(start, start + n)
    return chunk, positions


def run_chunk(cache, tokens, spans, width=CHUNK):
    """One chunk through the backbone and both MTP heads (head h reads the tokens h further
    on). -> (cache, main logits [B, width, V], MTP logits per head, positions)."""
    chunk, positions = chunk_of(tokens, spans, width)
    logits, h, cache = _backbone(cache, chunk, positions)
    mtp_logits = []
    for head in range(1, CFG.mtp.num_heads + 1):
        shifted, _ = chunk_of(np.pad(tokens[:, head:], ((0, 0), (0, head))), spans, width)
        head_logits, h, cache = _mtp(cache, head, h, shifted, positions)
        mtp_logits.append(np.asarray(head_logits))
    return cache, np.asarray(logits), mtp_logits, positions


def assert_all_match(got, got_mtp, positions, expected, expected_mtp):
    """Every valid position's main and MTP logits against the full forward's; returns how many
    positions were compared."""
    checked = 0
    for b in range(positions.shape[0]):
        for i, p in enumerate(positions[b]):
            if p < 0:
                continue
            np.testing.assert_allclose(got[b, i], expected[b, p], **TOL,
                                       err_msg=f"main row {b} position {p}")
            for head, (mine, theirs) in enumerate(zip(got_mtp, expected_mtp), 1):
                np.testing.assert_allclose(mine[b, i], theirs[b, p], **TOL,
                                           err_msg=f"mtp {head} row {b} position {p}")
            checked += 1
    return checked


@pytest.mark.slow
def test_incremental_logits_equal_full_forward():
    """Rows of 30 and 13 tokens in chunks of 1-3 tokens (rows at different offsets, one row
    padding while the other runs): every position's main and MTP logits equal the full
    forward's."""
    logits, mtp_logits, tokens = full_forward(SEQUENCES)
    lengths = [len(row) for row in SEQUENCES]
    cache = decoder().init_cache(2)
    done, checked = [0, 0], 0
    schedule = [(3, 2), (3, 3), (1, 1), (2, 3), (1, 0), (3, 2), (1, 3), (3, 1)] + [(1, 1)] * 30
    for sizes in schedule:
        spans = [(done[b], max(0, min(sizes[b], lengths[b] - done[b]))) for b in range(2)]
        if not any(n for _, n in spans):
            break
        cache, got, got_mtp, positions = run_chunk(cache, tokens, spans)
        checked += assert_all_match(got, got_mtp, positions, logits, mtp_logits)
        done = [start + n for start, n in spans]
    assert done == lengths and checked == sum(lengths)


@pytest.mark.slow
def test_prefill_chunk_wider_than_the_ring():
    """A first chunk of 16 tokens (row 1: all its 13) is wider than the SWA rings (10 slots):
    only its last 10 positions stay in the rings, and the one-token steps after it still see
    their whole window."""
    logits, mtp_logits, tokens = full_forward(SEQUENCES)
    cache = decoder().init_cache(2)
    cache, got, got_mtp, positions = run_chunk(cache, tokens, [(0, 16), (0, 13)], width=16)
    checked = assert_all_match(got, got_mtp, positions, logits, mtp_logits)
    for start in range(16, len(SEQUENCES[0])):
        cache, got, got_mtp, positions = run_chunk(cache, tokens, [(start, 1), (0, 0)])
        checked += assert_all_match(got, got_mtp, positions, logits, mtp_logits)
    assert checked == len(SEQUENCES[0]) + len(SEQUENCES[1])


def test_rolled_back_drafts_leave_no_trace():
    """A verify chunk [14, drafts 15 and 16] whose two drafts are wrong overwrites ring slots
    of the backbone and of both MTP heads; it is rolled back by starting the next chunk at 14
    (the MTP heads' entries at 14 read the wrong token 15 / 16, as the decoder's re-draft after
    a verify recomputes them): main and MTP logits equal the full forward's, also after the
    rings have wrapped again."""
    rows = [SEQUENCES[0], SEQUENCES[0][::-1]]
    logits, mtp_logits, tokens = full_forward(rows)
    cache = decoder().init_cache(2)
    for start in range(0, 12, 3):
        cache, *_ = run_chunk(cache, tokens, [(start, 3)] * 2)
    cache, *_ = run_chunk(cache, tokens, [(12, 2)] * 2)
    wrong = tokens.copy()
    wrong[:, 15:17] = (wrong[:, 15:17] + [5, 9]) % 64  # position 14 is right, 15 and 16 not
    cache, *_ = run_chunk(cache, wrong, [(14, 3)] * 2)
    # Control: the wrong drafts change the logits of the positions that see them, so a cache
    # that kept them would fail below.
    wrong_logits, _, _ = full_forward([row[:len(rows[0])] for row in wrong])
    assert np.max(np.abs(wrong_logits[:, 17:len(rows[0])] - logits[:, 17:len(rows[0])])) > 1e-2
    checked = 0
    for start in range(14, len(rows[0]), 3):
        n = min(3, len(rows[0]) - start)
        cache, got, got_mtp, positions = run_chunk(cache, tokens, [(start, n)] * 2)
        checked += assert_all_match(got, got_mtp, positions, logits, mtp_logits)
    assert checked == 2 * (len(rows[0]) - 14)


def greedy_reference(prompts, new_tokens):
    """The full forward's argmax, one token at a time over the growing sequences."""
    sequences = [list(p) for p in prompts]
    for _ in range(new_tokens):
        logits, _, _ = full_forward(sequences)
        for b, sequence in enumerate(sequences):
            sequence.append(int(np.argmax(logits[b, len(sequence) - 1])))
    return [sequence[len(p):] for sequence, p in zip(sequences, prompts)]


PROMPTS = [list(SEQUENCES[0][:11]), list(SEQUENCES[1][:4])]
NEW_TOKENS = 20  # row 0 ends at position 31: its rings wrap three times


@pytest.mark.slow
def test_greedy_generation_equals_full_forward_argmax():
    """... and records the experts the full forward chooses, which it replays exactly
    (tests/routing_checks.py)."""
    out = decoder().generate(PROMPTS, NEW_TOKENS, record_routing=True)
    assert out.tokens == greedy_reference(PROMPTS, NEW_TOKENS)
    check_recorded_routes(_full_forward, PROMPTS, out, MAX_LEN)


@pytest.mark.slow
def test_greedy_speculative_equals_greedy():
    """Random (untrained) MTP heads: drafts are mostly rejected, so the rings roll back often."""
    plain = decoder().generate(PROMPTS, NEW_TOKENS)
    speculative = decoder().generate(PROMPTS, NEW_TOKENS, speculative=True)
    assert speculative.tokens == plain.tokens
    assert 1.0 <= speculative.mean_accepted <= 1.0 + DRAFT


def test_cache_bytes_follow_the_per_type_geometry():
    """float32 keys of 24 dims and values of 16 per KV head, plus an int32 position per slot:
    the 2 full layers (1 KV head) grow by one entry per position; the 4 SWA layers and the 2
    MTP heads' SWA blocks (2 KV heads) keep rings of window + draft = 10 slots."""
    def sizes_at(max_len):
        decoder = Decoder(CFG, VARIABLES, max_len=max_len, draft=DRAFT)
        return cache_bytes(CFG, jax.eval_shape(lambda v: decoder._init_cache(v, 1), VARIABLES))

    small, large = sizes_at(16), sizes_at(48)
    assert large["full"] - small["full"] == 32 * 2 * (1 * (24 + 16) * 4 + 4)
    assert small["swa"] == large["swa"] == (4 + 2) * 10 * (2 * (24 + 16) * 4 + 4)
    assert small["compressed"] == small["indexer"] == 0
