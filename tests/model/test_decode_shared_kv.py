"""KV-cache decoding of DeepSeek-V4 models (layers W, C, H with mHC, a hash-routed MoE layer and
MTP heads on W blocks; model/inference/compressed_cache.py), checked against the training-path
full forward pass of CausalLM: logits of every position, greedy generation, speculative
decoding and rolled-back drafts."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from routing_checks import check_recorded_routes, model_forward
from train_helpers import SMALL_V4, TINY_V4

from model.config import load_config
from model.inference.cache_memory import cache_bytes
from model.inference.decode import Decoder
from model.inference.kv_cache import KVCacheSpec
from model.lm import CausalLM, init_variables

# CSA rate 4 and HCA rate 8 with chunks of at most 3 tokens: every chunk boundary splits
# compression blocks; window 8 with 21 tokens: the window rings wrap around.
CFG = load_config(TINY_V4, [o.removeprefix("model.") for o in SMALL_V4 if o.startswith("model.")]
                  + ["shared_kv_attention.csa_rate=4", "shared_kv_attention.hca_rate=8",
                     "mtp.num_heads=2", "vocab_size=64", "init_std=0.2"])
VARIABLES = nn.meta.unbox(init_variables(CausalLM(CFG), jax.random.key(1)))
MAX_LEN, DRAFT, CHUNK = 32, 2, 3
SEQUENCES = [np.random.default_rng(0).integers(0, 64, 21),
             np.random.default_rng(1).integers(0, 64, 12)]
TOL = dict(rtol=1e-5, atol=1e-5)


def test_config_covers_every_v4_feature():
    assert set(CFG.layout) == set("WCH") and CFG.hyper_connections.hc_mult == 2
    assert CFG.moe.hash_layers == 1 and CFG.mtp.attention_type == "W"


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


def chunk_of(tokens, spans):
    """Tokens, positions [B, CHUNK] of positions start..start+n-1 per row for spans
    [(start, n)]; -1 elsewhere (padding)."""
    chunk = np.zeros((len(spans), CHUNK), np.int32)
    positions = np.full((len(spans), CHUNK), -1, np.int32)
    for b, (start, n) in enumerate(spans):
        chunk[b, :n] = tokens[b, start:start + n]
        positions[b, :n] = np.arange(start, start + n)
    return chunk, positions


def run_chunk(cache, tokens, spans, heads=0):
    """One chunk through the backbone and the first `heads` MTP heads (head h reads the tokens
    h further on). -> (cache, main logits [B, CHUNK, V], MTP logits per head, positions)."""
    chunk, positions = chunk_of(tokens, spans)
    logits, h, cache = _backbone(cache, chunk, positions)
    mtp_logits = []
    for head in range(1, heads + 1):
        shifted, _ = chunk_of(np.pad(tokens[:, head:], ((0, 0), (0, head))), spans)
        head_logits, h, cache = _mtp(cache, head, h, shifted, positions)
        mtp_logits.append(np.asarray(head_logits))
    return cache, np.asarray(logits), mtp_logits, positions


def assert_logits_match(got, positions, expected, what):
    for b in range(positions.shape[0]):
        for i, p in enumerate(positions[b]):
            if p >= 0:
                np.testing.assert_allclose(got[b, i], expected[b, p], **TOL,
                                           err_msg=f"{what} row {b} position {p}")


@pytest.mark.slow
def test_incremental_logits_equal_full_forward():
    """Rows of 21 and 12 tokens fed in chunks of 1-3 tokens (the rows' chunks split blocks at
    different places): every position's main and MTP logits equal the full forward's."""
    logits, mtp_logits, tokens = full_forward(SEQUENCES)
    lengths = [len(row) for row in SEQUENCES]
    cache = decoder().init_cache(2)
    done = [0, 0]
    schedule = [(3, 2), (3, 3), (1, 1), (2, 3), (1, 1), (3, 2), (1, 3), (3, 1)] + [(1, 1)] * 20
    for sizes in schedule:
        spans = [(done[b], max(0, min(sizes[b], lengths[b] - done[b]))) for b in range(2)]
        if not any(n for _, n in spans):
            break
        cache, got, got_mtp, positions = run_chunk(cache, tokens, spans, heads=2)
        assert_logits_match(got, positions, logits, "main")
        for head in range(2):
            assert_logits_match(got_mtp[head], positions, mtp_logits[head], f"mtp {head + 1}")
        done = [start + n for start, n in spans]
    assert done == lengths


@pytest.mark.slow
def test_rolled_back_drafts_leave_no_trace():
    """A verify chunk whose wrong drafts complete a CSA block (positions 12..15) and an HCA
    block (8..15) is rolled back; decoding resumes at position 14: the entries are recomputed
    from the right tokens and the logits equal the full forward."""
    rows = [SEQUENCES[0], SEQUENCES[0][::-1]]
    logits, _, tokens = full_forward(rows)
    cache = decoder().init_cache(2)
    for start in range(0, 12, 3):
        cache, *_ = run_chunk(cache, tokens, [(start, 3)] * 2)
    cache, *_ = run_chunk(cache, tokens, [(12, 2)] * 2)
    wrong = tokens.copy()
    wrong[:, 14:16] = (wrong[:, 14:16] + [5, 9]) % 64  # position 13 was right, 14 and 15 not
    cache, *_ = run_chunk(cache, wrong, [(13, 3)] * 2)
    for start in range(14, len(rows[0]), 3):
        cache, got, _, positions = run_chunk(cache, tokens,
                                             [(start, min(3, len(rows[0]) - start))] * 2)
        assert_logits_match(got, positions, logits, "main")


def greedy_reference(prompts, new_tokens):
    """The full forward's argmax, one token at a time over the growing sequences."""
    sequences = [list(p) for p in prompts]
    for _ in range(new_tokens):
        logits, _, _ = full_forward(sequences)
        for b, sequence in enumerate(sequences):
            sequence.append(int(np.argmax(logits[b, len(sequence) - 1])))
    return [sequence[len(p):] for sequence, p in zip(sequences, prompts)]


PROMPTS = [list(SEQUENCES[0][:13]), list(SEQUENCES[1][:5])]


@pytest.mark.slow
def test_greedy_generation_equals_full_forward_argmax():
    """... and records the experts the full forward chooses, which it replays exactly
    (tests/routing_checks.py)."""
    out = decoder().generate(PROMPTS, 14, record_routing=True)
    assert out.tokens == greedy_reference(PROMPTS, 14)
    check_recorded_routes(_full_forward, PROMPTS, out, MAX_LEN)


@pytest.mark.slow
def test_greedy_speculative_equals_greedy():
    """Random (untrained) MTP heads on W blocks: drafts are mostly rejected, so the window rings
    and the compressed caches roll back often."""
    plain = decoder().generate(PROMPTS, 14)
    speculative = decoder().generate(PROMPTS, 14, speculative=True)
    assert speculative.tokens == plain.tokens
    assert 1.0 <= speculative.mean_accepted <= 1.0 + DRAFT


@pytest.mark.slow
def test_cache_bytes_by_kind():
    """Window rings do not grow with max_len; compressed entries and indexer keys grow by one
    entry per rate tokens: per C layer c + 1 int32 position per 4 tokens, per H layer per 8."""
    def sizes_at(max_len):
        decoder = Decoder(CFG, VARIABLES, max_len=max_len, draft=DRAFT)
        return cache_bytes(CFG, jax.eval_shape(lambda v: decoder._init_cache(v, 1), VARIABLES))

    sizes = {n: sizes_at(n) for n in (16, 48)}
    attn = CFG.shared_kv_attention
    assert sizes[16]["full"] == sizes[48]["full"] == 0
    assert sizes[16]["swa"] == sizes[48]["swa"] > 0
    csa, hca = CFG.layout.count("C"), CFG.layout.count("H")
    grown = {k: sizes[48][k] - sizes[16][k] for k in ("compressed", "indexer")}
    assert grown["compressed"] == (csa * 8 + hca * 4) * (attn.head_dim + 1) * 4
    assert grown["indexer"] == csa * 8 * (attn.index_head_dim + 1) * 4


CACHED_FP8 = CausalLM(CFG, KVCacheSpec(MAX_LEN, DRAFT, fp8=True))


@jax.jit
def _backbone_fp8(cache, tokens, positions):
    (normed, *_), mutated = CACHED_FP8.apply({**VARIABLES, "cache": cache}, tokens, positions,
                                            method=CausalLM.decode_chunk, mutable=["cache"])
    return CACHED_FP8.apply(VARIABLES, normed, method=CausalLM.project), mutated["cache"]


@pytest.mark.slow
def test_an_fp8_cache_reads_every_entry_as_stored():
    """KVCacheSpec.fp8: window and compressed entries stored in E4M3 but their RoPE channels.
    Every read goes through the format, so one token at a time and chunks of 3 give the same
    logits; those differ from the full forward's by the rounding alone (small, not zero)."""
    logits, _, tokens = full_forward(SEQUENCES)
    length = len(SEQUENCES[1])
    cache = Decoder(CFG, VARIABLES, max_len=MAX_LEN, kv_fp8=True).init_cache(2)
    runs = {}
    for size in (1, CHUNK):
        state, got = cache, np.zeros((2, length, logits.shape[-1]), np.float32)
        for start in range(0, length, size):
            chunk, positions = chunk_of(tokens, [(start, min(size, length - start))] * 2)
            step, state = _backbone_fp8(state, chunk, positions)
            got[:, start:start + size] = np.asarray(step)[:, :min(size, length - start)]
        runs[size] = got
    np.testing.assert_allclose(runs[1], runs[CHUNK], rtol=1e-5, atol=1e-5)
    error = np.abs(runs[1] - logits[:, :length]).max() / np.abs(logits[:, :length]).max()
    assert 1e-5 < error < 0.2, error
    window = cache["layers"]["segment_0"]["block_0"]["self_attn"]["window_kv"]
    attn = CFG.shared_kv_attention
    assert window.kept.shape[-1] == attn.rope_dims  # the trailing RoPE channels, unquantized
    assert window.values.shape[-1] == attn.head_dim - attn.rope_dims
