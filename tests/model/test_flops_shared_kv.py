"""model.flops on DeepSeek-V4 layers (W / C / H shared-KV attention) and mHC: FLOPs against a
brute-force walk over query positions, prefill = Σ decode, KV-cache bytes by hand."""

from collections import Counter
from pathlib import Path

import pytest

from model.config import load_config
from model.flops import forward_flops, kv_cache_bytes, main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
FLASH = str(ROOT / "configs" / "deepseek_v4_flash.yaml")
# Window 5, CSA blocks of 2 with top-3 selection, HCA blocks of 4: the window, the block
# boundaries and the top-k cap all fall inside contexts of a few tokens.
V4_TINY = ["num_layers=6", "layout=WCHCHW", "window=5", "swiglu_limits=0",
           "swiglu_limits_shared=0", "moe.hash_layers=2", "hyper_connections.hc_mult=3",
           "mtp.num_heads=2", "mtp.attention_type=W", "shared_kv_attention.num_heads=4",
           "shared_kv_attention.head_dim=16", "shared_kv_attention.rope_dims=4",
           "shared_kv_attention.q_lora_rank=12", "shared_kv_attention.o_groups=2",
           "shared_kv_attention.o_lora_rank=6", "shared_kv_attention.csa_rate=2",
           "shared_kv_attention.hca_rate=4", "shared_kv_attention.index_heads=3",
           "shared_kv_attention.index_head_dim=8", "shared_kv_attention.index_topk=3"]


def window_entries(query: int, window: int) -> int:
    """Tokens j <= query with query - j < window."""
    return sum(1 for j in range(query + 1) if query - j < window)


def complete_blocks(query: int, rate: int) -> int:
    """Blocks w (tokens w*rate .. (w+1)*rate - 1) whose last token is at or before `query`."""
    return sum(1 for w in range(query + 1) if (w + 1) * rate - 1 <= query)


def selected_blocks(query: int, rate: int, topk: int) -> int:
    """The indexer keeps up to `topk` of the complete blocks."""
    kept = 0
    for _ in range(complete_blocks(query, rate)):
        if kept < topk:
            kept += 1
    return kept


def brute_force(cfg, context: int, mode: str) -> Counter:
    """Every query position through every layer: 2*m*n per [m, n] weight, 2*c per head for each
    of q.k and p*v per attended entry, 2*c^I per indexer head per scored block."""
    a, d, n, moe = cfg.shared_kv_attention, cfg.d_model, cfg.hyper_connections.hc_mult, cfg.moe
    c, heads = a.head_dim, a.num_heads
    flops = Counter()

    def matmuls(key, *shapes):
        for rows, cols in shapes:
            flops[key] += 2 * rows * cols

    def attention(query, kind, key_of):
        matmuls(key_of("attention_projections"), (d, a.q_lora_rank),
                (a.q_lora_rank, heads * c), (d, c), (a.o_groups * a.o_lora_rank, d))
        for _ in range(a.o_groups):  # grouped o_a: each group its own heads' slice
            matmuls(key_of("attention_projections"), (heads // a.o_groups * c, a.o_lora_rank))
        entries = window_entries(query, cfg.window)
        if kind == "H":
            matmuls(key_of("kv_compressor"), (d, c), (d, c))
            entries += complete_blocks(query, a.hca_rate)
        if kind == "C":
            matmuls(key_of("kv_compressor"), (d, 2 * c), (d, 2 * c))
            matmuls(key_of("indexer_projections"), (d, 2 * a.index_head_dim),
                    (d, 2 * a.index_head_dim),
                    (a.q_lora_rank, a.index_heads * a.index_head_dim), (d, a.index_heads))
            entries += selected_blocks(query, a.csa_rate, a.index_topk)
            for _ in range(a.index_heads):
                for _ in range(complete_blocks(query, a.csa_rate)):
                    flops[key_of("indexer_scores")] += 2 * a.index_head_dim
        for _ in range(heads):
            for _ in range(entries):
                flops[key_of("attention_scores")] += 2 * c + 2 * c

    def swiglu(key, hidden):
        matmuls(key, (d, hidden), (d, hidden), (hidden, d))

    queries = [context - 1] if mode == "decode" else range(context)
    for query in queries:
        for layer, kind in enumerate(cfg.layout):
            matmuls("hyper_connections", (n * d, (2 + n) * n), (n * d, (2 + n) * n))
            attention(query, kind, lambda key: key)
            if layer < cfg.num_dense_layers:
                swiglu("ffn_dense", cfg.dense_hidden)
                continue
            matmuls("router", (d, moe.num_experts))  # hash layers too: the gates use them
            for _ in range(moe.top_k):
                swiglu("moe_experts", moe.expert_hidden)
            for _ in range(moe.num_shared_experts):
                swiglu("moe_experts", moe.shared_hidden)
        matmuls("hyper_connections", (n * d, n))
        matmuls("lm_head", (d, cfg.vocab_size))
        for _ in range(cfg.mtp.num_heads):
            matmuls("mtp", (2 * d, d))
            attention(query, cfg.mtp.attention_type, lambda key: "mtp")
            swiglu("mtp", cfg.dense_hidden)
            matmuls("mtp", (d, cfg.vocab_size))
    return flops


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_matches_brute_force(mode):
    cfg = load_config(TINY, V4_TINY)
    for context in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17):
        result = forward_flops(cfg, context, mode)
        assert Counter(result["breakdown"]) == brute_force(cfg, context, mode), context
        assert result["total"] == sum(result["breakdown"].values())


def test_without_mhc_there_are_no_mapping_flops():
    cfg = load_config(TINY, V4_TINY + ["hyper_connections.hc_mult=1"])
    assert forward_flops(cfg, 9, "prefill")["breakdown"]["hyper_connections"] == 0


def test_prefill_is_the_sum_of_decodes():
    cfg = load_config(TINY, V4_TINY)
    for n in (1, 6, 19):
        total = Counter()
        for context in range(1, n + 1):
            total.update(forward_flops(cfg, context, "decode")["breakdown"])
        assert forward_flops(cfg, n, "prefill")["breakdown"] == dict(total), n


def test_prefill_increment_is_decode_on_the_flash_preset():
    """Past the window (128), HCA blocks (128) and CSA's top-k cap (8 blocks of 4 here)."""
    cfg = load_config(FLASH, ["shared_kv_attention.index_topk=8"])
    before = forward_flops(cfg, 1, "prefill")["breakdown"]
    for n in range(1, 300):
        after = forward_flops(cfg, n + 1, "prefill")["breakdown"]
        step = forward_flops(cfg, n + 1, "decode")["breakdown"]
        assert {k: after[k] - before[k] for k in after} == step, n
        before = after


def expected_kv_bytes(cfg, context: int, main_entry: int, index_key: int) -> int:
    """Loop over layers: window entries, complete blocks, indexer keys (C) at the given bytes."""
    a, total = cfg.shared_kv_attention, 0
    for kind in list(cfg.layout) + [cfg.mtp.attention_type] * cfg.mtp.num_heads:
        total += min(context, cfg.window) * main_entry
        if kind in "CH":
            rate = a.csa_rate if kind == "C" else a.hca_rate
            total += (context // rate) * main_entry
        if kind == "C":
            total += (context // a.csa_rate) * index_key
    return total


def test_kv_cache_bytes_by_hand():
    """Layout WCH + one W MTP block, window 5, c = 16 (4 RoPE dims), c^I = 8, bfloat16, at 9
    tokens: W 5 entries; C 5 + 9//2 = 4 entries and 4 indexer keys; H 5 + 9//4 = 2 entries."""
    cfg = load_config(TINY, V4_TINY + ["num_layers=3", "layout=WCH", "mtp.num_heads=1",
                                       "compute_dtype=bfloat16"])
    assert kv_cache_bytes(cfg, 9) == (5 + 9 + 7 + 5) * 16 * 2 + 4 * 8 * 2 == 896
    # release: 4 * 2 + 12 * 1 = 20 bytes per entry, 8 / 2 = 4 per FP4 indexer key
    assert kv_cache_bytes(cfg, 9, "v4_release") == (5 + 9 + 7 + 5) * 20 + 4 * 4 == 536
    assert forward_flops(cfg, 9, "decode")["kv_cache_bytes_v4_release"] == 536


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("bfloat16", 2)])
def test_kv_cache_bytes_against_a_loop(dtype, itemsize):
    cfg = load_config(TINY, V4_TINY + [f"compute_dtype={dtype}"])
    a = cfg.shared_kv_attention
    for context in (1, 4, 5, 6, 11, 40):
        assert kv_cache_bytes(cfg, context) == expected_kv_bytes(
            cfg, context, a.head_dim * itemsize, a.index_head_dim * itemsize), context
        assert kv_cache_bytes(cfg, context, "v4_release") == expected_kv_bytes(
            cfg, context, 2 * a.rope_dims + a.head_dim - a.rope_dims, a.index_head_dim // 2)


def test_rejects_an_unknown_storage():
    with pytest.raises(ValueError, match="storage"):
        kv_cache_bytes(load_config(TINY, V4_TINY), 8, "fp8")


def test_flash_kv_cache_is_about_2_percent_of_gqa8():
    """Report §2.3.4: at 1M context V4's KV cache is ~2% of a BF16 GQA-8 (head dim 128) one."""
    context = 1 << 20
    gqa8 = 43 * context * 2 * 8 * 128 * 2  # 43 layers, K and V, 8 heads of 128, 2 bytes
    flash = load_config(FLASH, ["mtp.num_heads=0"])
    assert 0.015 < kv_cache_bytes(flash, context, "v4_release") / gqa8 < 0.025


def test_cli_table_lists_the_v4_components(capsys):
    assert main(["--config", FLASH, "--context", "4096", "--mode", "decode"]) == 0
    table = capsys.readouterr().out
    for name in ("kv_compressor", "indexer_scores", "hyper_connections", "as DeepSeek-V4 stores"):
        assert name in table
