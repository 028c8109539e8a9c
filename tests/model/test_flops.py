"""model.flops: analytic FLOPs and KV-cache bytes vs brute-force counts from explicit loops."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from model.config import load_config
from model.flops import BREAKDOWN, forward_flops, kv_cache_bytes, main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
TINY_MIMO = str(ROOT / "configs" / "tiny_mimo.yaml")
MIMO = str(ROOT / "configs" / "mimo_v2_flash.yaml")
ABLATION = ROOT / "configs" / "ablation"


def visible_keys(query: int, window: int | None) -> int:
    """Keys j that query i sees: j <= i and, on SWA layers, i - j < W (docs/architecture.md,
    "Exact semantics")."""
    return sum(1 for j in range(query + 1) if window is None or query - j < window)


def brute_force(cfg, context: int, mode: str) -> Counter:
    """Walks every token position through every layer, adding 2*m*n per [m, n] weight it meets
    and 2*hd FLOPs per (head, visible key) for each of QK^T and PV."""
    assert cfg.moe_layers is None
    d, moe = cfg.d_model, cfg.moe
    flops = Counter()

    def matmuls(key, *shapes):
        for m, n in shapes:
            flops[key] += 2 * m * n

    def attention(query, attention_type, projections_key, scores_key):
        # per-type fields where set (MiMo-V2-Flash), else the model's
        typed = cfg.full_attention if attention_type == "F" else cfg.swa_attention
        h = typed.num_heads
        hd, kv = typed.head_dim or cfg.head_dim, typed.num_kv_heads or cfg.num_kv_heads
        vd = typed.v_head_dim or cfg.v_head_dim or hd
        matmuls(projections_key, (d, h * hd), (d, kv * hd), (d, kv * vd), (h * vd, d))
        if (typed.gate or cfg.gate) == "headwise":
            matmuls(projections_key, (d, h))
        window = cfg.window if attention_type == "S" else None
        for _ in range(h):
            for _ in range(visible_keys(query, window)):
                flops[scores_key] += 2 * hd + 2 * vd  # q.k, then p * v

    def swiglu(key, hidden):
        matmuls(key, (d, hidden), (d, hidden), (hidden, d))

    queries = [context - 1] if mode == "decode" else range(context)
    for query in queries:
        for layer, attention_type in enumerate(cfg.layout):
            attention(query, attention_type, "attention_projections", "attention_scores")
            if layer < cfg.num_dense_layers:
                swiglu("ffn_dense", cfg.dense_hidden)
                continue
            matmuls("router", (d, moe.num_experts))
            for _ in range(moe.top_k):
                swiglu("moe_experts", moe.expert_hidden)
            for _ in range(moe.num_shared_experts):
                swiglu("moe_experts", moe.shared_hidden)
        matmuls("lm_head", (d, cfg.vocab_size))
        for _ in range(cfg.mtp.num_heads):
            matmuls("mtp", (2 * d, d))
            attention(query, "S", "mtp", "mtp")
            swiglu("mtp", cfg.dense_hidden)
            matmuls("mtp", (d, cfg.vocab_size))
    return flops


@pytest.mark.parametrize("preset, overrides", [(TINY, []),
                                               (TINY, ["gate=none", "swa_attention.num_heads=8"]),
                                               (TINY_MIMO, [])])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_matches_brute_force(mode, preset, overrides):
    cfg = load_config(preset, overrides)
    w = cfg.window
    for context in (1, 5, w - 1, w, w + 1, 2 * w + 7):
        result = forward_flops(cfg, context, mode)
        assert Counter(result["breakdown"]) == brute_force(cfg, context, mode), context
        assert result["total"] == sum(result["breakdown"].values())


def test_prefill_increment_is_decode():
    """prefill(N+1) - prefill(N) = decode at context N+1, for every component."""
    cfg = load_config(TINY)
    for n in (1, 7, cfg.window - 1, cfg.window, cfg.window + 3, 200):
        before = forward_flops(cfg, n, "prefill")["breakdown"]
        after = forward_flops(cfg, n + 1, "prefill")["breakdown"]
        step = forward_flops(cfg, n + 1, "decode")["breakdown"]
        assert {k: after[k] - before[k] for k in after} == step, n


def expected_kv_bytes(cfg, context: int) -> int:
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.compute_dtype]
    total = 0
    for attention_type in list(cfg.layout) + ["S"] * cfg.mtp.num_heads:
        entries = context if attention_type == "F" else min(context, cfg.window)
        total += entries * cfg.num_kv_heads * cfg.head_dim * 2 * itemsize  # 2 = K and V
    return total


@pytest.mark.parametrize("overrides", [[], ["compute_dtype=bfloat16", "mtp.num_heads=0"]])
def test_kv_cache_bytes(overrides):
    cfg = load_config(TINY, overrides)
    for context in (1, cfg.window, cfg.window + 1, 1000):
        assert kv_cache_bytes(cfg, context) == expected_kv_bytes(cfg, context)
        for mode in ("decode", "prefill"):
            assert forward_flops(cfg, context, mode)["kv_cache_bytes"] == expected_kv_bytes(
                cfg, context)


def test_swa_kv_cache_stops_growing_at_the_window():
    swa_only = load_config(TINY, ["layout=S*9"])
    w = swa_only.window
    assert kv_cache_bytes(swa_only, w - 1) < kv_cache_bytes(swa_only, w)
    assert kv_cache_bytes(swa_only, w) == kv_cache_bytes(swa_only, w + 1) == kv_cache_bytes(
        swa_only, 100 * w)
    full_only = load_config(TINY, ["layout=F*9", "mtp.num_heads=0"])
    assert kv_cache_bytes(full_only, 2 * w) == 2 * kv_cache_bytes(full_only, w)


def test_mimo_v2_flash_kv_bytes_by_hand():
    """Per token in bfloat16: a full layer keeps 4 KV heads x (192 + 128) values = 2,560 B for
    every position; an SWA layer (39 + the 3 MTP blocks) 8 x (192 + 128) values = 5,120 B for
    min(N, 129) positions."""
    cfg = load_config(MIMO)
    assert cfg.compute_dtype == "bfloat16"
    full, swa = 4 * (192 + 128) * 2, 8 * (192 + 128) * 2
    assert (full, swa) == (2560, 5120)
    for n in (1, 128, 129, 130, 32768, 262144):
        assert kv_cache_bytes(cfg, n) == 9 * n * full + (39 + 3) * min(n, 129) * swa, n
    # far past the window, the full layers' share: (9 x 2,560) / (9 x 2,560 + 42 x 129 x 5,120 / N)
    assert kv_cache_bytes(cfg, 1 << 20) == 9 * 2560 * (1 << 20) + 42 * 129 * 5120


def test_mimo_v2_flash_decode_attention_by_hand():
    """One decode token at context N: QK^T and PV of 64 heads over (192 + 128) dims, N keys on
    the 9 full layers and 129 on the 39 SWA layers and the 3 MTP blocks."""
    cfg = load_config(MIMO)
    n = 32768
    scores = forward_flops(cfg, n, "decode")["breakdown"]["attention_scores"]
    assert scores == 2 * 64 * (192 + 128) * (9 * n + 39 * 129)


def test_layout_trend_follows_table8():
    """Report Table 8 (30B-A3B): FFFF costs several times S3F1 at 64k/256k, more so at 256k."""
    def attention_side(layout, context, mode):
        breakdown = forward_flops(load_config(ABLATION / f"30b_a3b_{layout}.yaml"), context,
                                  mode)["breakdown"]
        return breakdown["attention_projections"] + breakdown["attention_scores"]

    for mode in ("decode", "prefill"):
        ratios = [attention_side("FFFF", n, mode) / attention_side("S3F1", n, mode)
                  for n in (65536, 262144)]
        assert 2 < ratios[0] < ratios[1] < 5, (mode, ratios)


@pytest.mark.parametrize("context, mode", [(0, "decode"), (-3, "prefill"), (4, "train")])
def test_rejects_bad_context_and_mode(context, mode):
    with pytest.raises(ValueError, match="context" if context < 1 else "mode"):
        forward_flops(load_config(TINY), context, mode)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "model.flops", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_json():
    proc = run_cli("--config", TINY, "--context", "40", "--json", "--mode", "prefill",
                   "mtp.num_heads=1")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"total", "breakdown", "kv_cache_bytes", "kv_cache_bytes_v4_release"} <= out.keys()
    cfg = load_config(TINY, ["mtp.num_heads=1"])
    # every component is listed, those a GQA model lacks (DeepSeek-V4's) as 0
    assert out["breakdown"] == dict.fromkeys(BREAKDOWN, 0) | brute_force(cfg, 40, "prefill")
    # no shared-KV layers: the release's storage changes nothing
    assert out["kv_cache_bytes"] == out["kv_cache_bytes_v4_release"] == expected_kv_bytes(cfg, 40)


def test_cli_bad_context_is_one_line_exit_2():
    proc = run_cli("--config", TINY, "--context", "0", "--mode", "decode")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "context" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, needle", [
    (["--config", TINY, "--context", "8", "--mode", "train"], "--mode"),
    (["--config", TINY, "--context", "eight", "--mode", "decode"], "--context"),
    (["--config", "no/such.yaml", "--context", "8", "--mode", "decode"], "no/such.yaml"),
    (["--config", TINY, "--context", "8", "--mode", "decode", "moe.bogus=1"], "moe.bogus"),
])
def test_cli_bad_input(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err


def test_cli_help_and_table(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "kv_cache_bytes" in capsys.readouterr().out
    assert main(["--config", TINY, "--context", "64", "--mode", "decode"]) == 0
    table = capsys.readouterr().out
    assert "attention_scores" in table and "KV cache" in table
