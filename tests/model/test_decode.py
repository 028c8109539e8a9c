"""KV-cache decoding, sampling and MTP speculative decoding (model.decode / kv_cache /
sampling / speculative), checked against the plain full-sequence forward pass."""

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import SMALL_MODEL, TINY

from model.config import load_config
from model.inference import decode
from model.inference.cache_memory import cache_bytes
from model.inference.decode import Decoder
from model.inference.kv_cache import KVCacheSpec
from model.inference.sampling import Sampling, token_probs
from model.inference.speculative import accept_drafts
from model.lm import CausalLM, init_variables

# Window 8 with sequences of ~24 tokens: every SWA ring wraps around several times.
CFG = load_config(TINY, [o.removeprefix("model.") for o in SMALL_MODEL]
                  + ["mtp.num_heads=3", "vocab_size=64", "init_std=0.2"])
VARIABLES = nn.meta.unbox(init_variables(CausalLM(CFG), jax.random.key(1)))
SEQUENCES = [np.random.default_rng(0).integers(0, 64, 24), np.random.default_rng(1).integers(0, 64, 15)]


@jax.jit
def _full_forward(tokens):
    out = CausalLM(CFG).apply(VARIABLES, tokens)
    return out.logits, out.mtp_logits


def full_forward(tokens):
    """Logits of the training-path forward of one unpadded row: main [T, V], MTP h [T, V]."""
    logits, mtp_logits = _full_forward(jnp.asarray(tokens)[None])
    return np.asarray(logits[0]), [np.asarray(m[0]) for m in mtp_logits]


CACHED = CausalLM(CFG, KVCacheSpec(max_len=32, draft=3))


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


class CachedModel:
    """Drives CausalLM(kv_cache=(32, draft 3)) chunk by chunk, keeping the cache collection."""

    def __init__(self, batch):
        self.cache = Decoder(CFG, VARIABLES, max_len=32, draft=3).init_cache(batch)

    def backbone(self, tokens, positions):
        logits, h, self.cache = _backbone(self.cache, jnp.asarray(tokens, jnp.int32),
                                          jnp.asarray(positions, jnp.int32))
        return np.asarray(logits), h

    def mtp(self, head, h_prev, tokens, positions):
        logits, h, self.cache = _mtp(self.cache, head, h_prev, jnp.asarray(tokens, jnp.int32),
                                     jnp.asarray(positions, jnp.int32))
        return np.asarray(logits), h


def chunk_of(rows, start, size):
    """Tokens, positions [B, size] of positions start.. of each row; -1 past a row's end."""
    tokens = np.zeros((len(rows), size), np.int32)
    positions = np.full((len(rows), size), -1, np.int32)
    for b, row in enumerate(rows):
        n = max(0, min(size, len(row) - start))
        tokens[b, :n] = row[start:start + n]
        positions[b, :n] = np.arange(start, start + n)
    return tokens, positions


@pytest.mark.parametrize("chunk_sizes", [(5, 3, 1), (4,)])
def test_incremental_logits_equal_full_forward(chunk_sizes):
    """Rows of lengths 24 and 15 (window 8, ring 11): prefill chunks of the given sizes, then one
    token at a time; every position's main and MTP logits match the full forward."""
    cached = CachedModel(batch=2)
    expected = [full_forward(row) for row in SEQUENCES]
    # MTP head h at position t reads x_{t+h}; the full forward pads with 0 past the end.
    shifted = [np.concatenate([row, np.zeros(4, row.dtype)]) for row in SEQUENCES]
    sizes = list(chunk_sizes) + [1] * 24
    start = 0
    for size in sizes:
        if start >= max(len(r) for r in SEQUENCES):
            break
        tokens, positions = chunk_of(SEQUENCES, start, size)
        logits, h = cached.backbone(tokens, positions)
        for head in range(1, 4):
            head_tokens, _ = chunk_of([s[head:] for s in shifted], start, size)
            mtp_logits, h = cached.mtp(head, h, head_tokens, positions)
            for b in range(2):
                for i, p in enumerate(positions[b]):
                    if p >= 0:
                        np.testing.assert_allclose(mtp_logits[b, i], expected[b][1][head - 1][p],
                                                   rtol=2e-4, atol=2e-4,
                                                   err_msg=f"mtp {head} row {b} position {p}")
        for b in range(2):
            for i, p in enumerate(positions[b]):
                if p >= 0:
                    np.testing.assert_allclose(logits[b, i], expected[b][0][p], rtol=2e-4,
                                               atol=2e-4, err_msg=f"row {b} position {p}")
        start += size


def test_rolled_back_drafts_leave_no_trace():
    """A verify chunk of 3 wrong drafts written past the window, then decoding resumes right
    after the first token: logits equal the full forward of the true sequence."""
    row = SEQUENCES[0]
    expected, _ = full_forward(row)
    cached = CachedModel(batch=1)
    cached.backbone(row[None, :13], np.arange(13)[None])
    wrong = np.array([[row[13], (row[14] + 1) % 64, (row[15] + 7) % 64, (row[16] + 3) % 64]])
    cached.backbone(wrong, np.arange(13, 17)[None])  # position 13 is right, 14..16 are not
    logits, _ = cached.backbone(row[None, 14:18], np.arange(14, 18)[None])
    np.testing.assert_allclose(logits[0], expected[14:18], rtol=2e-4, atol=2e-4)
    for p in range(18, 24):
        logits, _ = cached.backbone(row[None, p:p + 1], [[p]])
        np.testing.assert_allclose(logits[0, 0], expected[p], rtol=2e-4, atol=2e-4)


def test_swa_cache_is_flat_in_context_length():
    sizes = {n: cache_bytes(CFG, Decoder(CFG, VARIABLES, max_len=n, draft=3).init_cache(1))
             for n in (16, 64)}
    assert sizes[16]["swa"] == sizes[64]["swa"] > 0
    full_layers = CFG.layout.count("F")
    per_position = full_layers * 2 * CFG.num_kv_heads * CFG.head_dim * 4 + full_layers * 4
    assert sizes[64]["full"] - sizes[16]["full"] == 48 * per_position


def test_an_fp8_cache_keeps_the_rope_channels_of_keys():
    """`kv_fp8`: per full-layer position and KV head, keys hold their rotary dims in the compute
    dtype (float32 here) and the other dims as one byte each plus a one-byte exponent per 64;
    values (no RoPE) are all E4M3."""
    def full_bytes(max_len, fp8):
        decoder = Decoder(CFG, VARIABLES, max_len=max_len, kv_fp8=fp8)
        return cache_bytes(CFG, jax.eval_shape(lambda v: decoder._init_cache(v, 1),
                                               VARIABLES))["full"]

    geo = CFG.attention_geometry("F")
    rest = geo.head_dim - geo.rotary_dims
    key = geo.rotary_dims * 4 + rest + -(-rest // 64)
    value = geo.v_head_dim + -(-geo.v_head_dim // 64)
    per_position = CFG.layout.count("F") * (geo.num_kv_heads * (key + value) + 4)
    assert 0 < geo.rotary_dims < geo.head_dim
    assert full_bytes(48, True) - full_bytes(16, True) == 32 * per_position
    assert full_bytes(16, True) < full_bytes(16, False)


@functools.lru_cache(maxsize=1)
def shared_decoder():
    return Decoder(CFG, VARIABLES, max_len=48, draft=3, prefill_chunk=8)


def greedy_decoder(variables=VARIABLES):
    """One compiled decoder for every test, with the given weights."""
    return shared_decoder().with_variables(variables)


def test_greedy_speculative_equals_greedy():
    """Random (untrained) MTP heads: drafts are mostly rejected, so caches roll back often."""
    prompts = [list(SEQUENCES[0][:11]), list(SEQUENCES[1][:3])]
    decoder = greedy_decoder()
    plain = decoder.generate(prompts, 20)
    speculative = decoder.generate(prompts, 20, speculative=True)
    assert speculative.tokens == plain.tokens
    assert [len(t) for t in plain.tokens] == [20, 20]
    assert plain.mean_accepted == 1.0 and 1.0 <= speculative.mean_accepted <= 4.0


def copying_variables(wrong_heads=()):
    """Attention and FFN outputs zeroed, so the main model's next token depends only on the
    current one; MTP heads that pass the embedding through eh_proj and share the main output
    layer then predict exactly the greedy continuation, except heads in `wrong_heads`, whose
    output layer is replaced with a random one."""
    def zero_outputs(path, leaf):
        names = {getattr(p, "key", "") for p in path}
        return jnp.zeros_like(leaf) if names & {"o_proj", "down_proj"} else leaf

    params = jax.tree_util.tree_map_with_path(zero_outputs, VARIABLES["params"])
    d = CFG.d_model
    for h in range(CFG.mtp.num_heads):
        head = dict(params[f"mtp_{h}"])
        head["eh_proj"] = {"kernel": jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], 0)}
        output = params["lm_head"]["kernel"]
        if h + 1 in wrong_heads:
            output = jax.random.normal(jax.random.key(h), output.shape)
        head["output_head"] = {"kernel": output}
        params[f"mtp_{h}"] = head
    return {**VARIABLES, "params": params}


@pytest.mark.parametrize("wrong_heads, accepted_range", [((), (4.0, 4.0)), ((3,), (3.0, 3.9))])
def test_speculative_accepts_correct_drafts(wrong_heads, accepted_range):
    variables = copying_variables(wrong_heads)
    decoder = greedy_decoder(variables)
    prompts = [list(SEQUENCES[0][:5]), list(SEQUENCES[1][:9])]
    plain = decoder.generate(prompts, 21)
    speculative = decoder.generate(prompts, 21, speculative=True)
    assert speculative.tokens == plain.tokens
    low, high = accepted_range
    assert low <= speculative.mean_accepted <= high
    assert speculative.forward_passes < plain.forward_passes


def test_stop_tokens_end_rows():
    decoder = greedy_decoder()
    prompts = [list(SEQUENCES[0][:6])]
    plain = decoder.generate(prompts, 12)
    stop = plain.tokens[0][4]
    first = plain.tokens[0].index(stop)
    for speculative in (False, True):
        out = decoder.generate(prompts, 12, stop_ids=[stop], speculative=speculative)
        assert out.tokens[0] == plain.tokens[0][:first + 1]


def test_on_tokens_streams_exactly_the_committed_tokens():
    """What `on_tokens` receives, after the prompt and then pass by pass, is what generate
    returns per row (a stop token ending a row early; speculative passes commit several)."""
    decoder, prompts = greedy_decoder(), [list(SEQUENCES[0][:7]), list(SEQUENCES[1][:4])]
    stop = decoder.generate(prompts, 10).tokens[0][5]
    for speculative in (False, True):
        calls = []
        out = decoder.generate(prompts, 10, speculative=speculative, stop_ids=[stop],
                               on_tokens=calls.append)
        assert [sum((c[b] for c in calls), []) for b in (0, 1)] == out.tokens
        assert len(calls) == out.forward_passes + 1


def test_generate_rejects_bad_requests():
    decoder = greedy_decoder()
    with pytest.raises(ValueError, match="max_len"):
        decoder.generate([[1] * 40], 10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.generate([[1, 99]], 2)
    with pytest.raises(ValueError, match="empty prompt"):
        decoder.generate([[]], 2)
    with pytest.raises(ValueError, match="top_p"):
        decoder.generate([[1]], 2, sampling=Sampling(1.0, top_p=0.0))
    with pytest.raises(ValueError, match="MTP heads"):
        Decoder(CFG, VARIABLES, max_len=8, draft=4)


def test_caches_beyond_memory_or_int32_positions_are_refused_before_allocating(monkeypatch):
    """Generated lengths are bounded: positions are int32, and caches that would not fit in
    free memory are refused from their shapes alone (nothing traced into a buffer)."""
    with pytest.raises(ValueError, match="positions are int32, so at most 2147483647"):
        Decoder(CFG, VARIABLES, max_len=2**31)
    decoder = Decoder(CFG, VARIABLES, max_len=10**5)  # full layers: 4 x 10^5 x 2 x 8 x 2 x 2
    monkeypatch.setattr(decode, "free_memory", lambda: 2**26)
    with pytest.raises(ValueError, match=r"the KV caches of 4 row\(s\) x 100000 positions need "
                                         r"0\.[0-9]+ GiB, more than the 0\.06 GiB of free memory; "
                                         "generate fewer new tokens"):
        decoder.init_cache(4)


def reference_probs(logits, temperature, top_k, top_p):
    """numpy float64: softmax(logits / T), then top-k, then the smallest nucleus >= top_p."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if top_k:
        z = np.where(np.isin(np.arange(len(z)), order[:top_k]), z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p or p[i] == 0:
            break
        kept.append(i)
        mass += p[i]
    out = np.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0),
                                                        (1.3, 0, 0.6), (0.9, 5, 0.8)])
def test_token_probs_match_reference(temperature, top_k, top_p):
    logits = np.random.default_rng(2).normal(size=(4, 10)).astype(np.float32) * 2
    got = np.asarray(token_probs(jnp.asarray(logits), Sampling(temperature, top_k, top_p)))
    for row, probs in zip(logits, got):
        np.testing.assert_allclose(probs, reference_probs(row, temperature, top_k, top_p),
                                   atol=1e-6)


def test_greedy_probs_are_one_hot_argmax():
    logits = np.random.default_rng(3).normal(size=(5, 7)).astype(np.float32)
    probs = np.asarray(token_probs(jnp.asarray(logits), Sampling()))
    np.testing.assert_array_equal(probs, np.eye(7)[logits.argmax(-1)])


CHI2_3DOF_P1E4 = 21.108  # chi-square critical value, 3 degrees of freedom, p = 1e-4


def chi_square(samples, probs):
    counts = np.bincount(samples, minlength=len(probs))
    expected = probs * len(samples)
    return float(np.sum((counts - expected) ** 2 / expected))


def test_rejection_sampling_preserves_the_target_distribution():
    """Target p_i independent of the prefix (a valid special case): each committed token must
    be distributed as p at its position, and the acceptance rate of d_1 is sum_v min(p, q)."""
    rng = np.random.default_rng(4)
    vocab, num_drafts, trials = 4, 2, 60_000
    target = rng.dirichlet(np.ones(vocab), size=num_drafts + 1)  # [D+1, V]
    draft = rng.dirichlet(np.ones(vocab), size=num_drafts)  # [D, V]
    drafts = np.stack([rng.choice(vocab, trials, p=q) for q in draft], axis=1)
    accepted, committed = accept_drafts(
        jax.random.key(5), jnp.broadcast_to(jnp.asarray(target, jnp.float32), (trials, 3, vocab)),
        jnp.broadcast_to(jnp.asarray(draft, jnp.float32), (trials, 2, vocab)), jnp.asarray(drafts))
    accepted, committed = np.asarray(accepted), np.asarray(committed)
    assert chi_square(committed[:, 0], target[0]) < CHI2_3DOF_P1E4
    assert chi_square(committed[accepted >= 1, 1], target[1]) < CHI2_3DOF_P1E4
    assert chi_square(committed[accepted >= 2, 2], target[2]) < CHI2_3DOF_P1E4
    rate = np.mean(accepted >= 1)
    assert abs(rate - np.minimum(target[0], draft[0]).sum()) < 0.01
    np.testing.assert_array_equal(committed[accepted >= 1, 0], drafts[accepted >= 1, 0])


# ---- python -m model.generate ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """CFG's weights as a stepjax model directory, plus a 64-word tokenizer.json."""
    import tokenizers

    from model.weights import save_model_dir

    root = tmp_path_factory.mktemp("generate")
    save_model_dir(CFG, VARIABLES, root / "model")
    words = ["<|endoftext|>", "[UNK]"] + [f"w{i}" for i in range(62)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(root / "tokenizer.json"))
    return root


def run_generate(capsys, *args):
    from model.generate import main

    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_generate_cli_json_and_speculative(model_dir, capsys):
    common = ["--workdir", str(model_dir / "model"), "--tokenizer",
              str(model_dir / "tokenizer.json"), "--prompt", "w3 w7 w9 w12 w5",
              "--max-new-tokens", "12", "--json"]
    code, out, err = run_generate(capsys, *common)
    assert code == 0, err
    plain = json.loads(out)
    code, out, err = run_generate(capsys, *common, "--speculative")
    assert code == 0, err
    speculative = json.loads(out)
    prompt = [int(w[1:]) + 2 for w in "w3 w7 w9 w12 w5".split()]
    expected = greedy_decoder().generate([prompt], 12, stop_ids=[0]).tokens[0]
    assert plain["token_ids"] == speculative["token_ids"] == expected
    assert plain["prompt_tokens"] == 5 and plain["mean_accepted_length"] == 1.0
    assert set(plain) >= {"text", "tokens_per_second", "mean_accepted_length"}


@pytest.mark.parametrize("args, problem", [
    (["--workdir", "/nonexistent/dir", "--prompt", "w1"], "does not exist"),
    (["--prompt", "w1", "--workdir", "{model}", "--tokenizer", "{tok}", "--draft", "5",
      "--speculative"], "--draft"),
    (["--prompt", "w1", "--workdir", "{model}", "--tokenizer", "{tok}", "--chat"], "--chat"),
    (["--prompt", "w1", "--workdir", "{model}", "--tokenizer", "{tok}", "--top-p", "0"], "top_p"),
])
def test_generate_cli_errors(model_dir, capsys, args, problem):
    args = [a.format(model=model_dir / "model", tok=model_dir / "tokenizer.json") for a in args]
    code, out, err = run_generate(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("error:") and problem in err and err.count("\n") == 1
