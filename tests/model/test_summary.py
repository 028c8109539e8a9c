"""model.summary: parameter counts vs report Table 6 and an independent hand count."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from model.config import load_config
from model.summary import count_params, main

ROOT = Path(__file__).resolve().parents[2]
STEP35 = str(ROOT / "configs" / "step35_flash.yaml")
TINY = str(ROOT / "configs" / "tiny.yaml")
TINY_MIMO = str(ROOT / "configs" / "tiny_mimo.yaml")
MIMO = str(ROOT / "configs" / "mimo_v2_flash.yaml")


def hand_count(cfg) -> dict:
    """Counts from the config fields alone, layer by layer (explicit weight shapes)."""
    assert cfg.moe_layers is None  # MoE layers are then exactly those after the dense ones
    d, moe = cfg.d_model, cfg.moe

    def block(attention_type: str, is_moe: bool) -> tuple[int, int]:
        """(total, active) of one decoder block."""
        # per-type fields where set (MiMo-V2-Flash), else the model's
        typed = cfg.full_attention if attention_type == "F" else cfg.swa_attention
        h = typed.num_heads
        hd, kv = typed.head_dim or cfg.head_dim, typed.num_kv_heads or cfg.num_kv_heads
        vd = typed.v_head_dim or cfg.v_head_dim or hd
        n = d * h * hd + d * kv * hd + d * kv * vd + h * vd * d  # q, k, v, o
        n += {"headwise": d * h, "sink": h, "none": 0}[typed.gate or cfg.gate]
        n += 2 * hd if cfg.qk_norm else 0  # q_norm, k_norm
        n += 2 * d  # input_layernorm, post_attention_layernorm
        if not is_moe:
            n += 3 * d * cfg.dense_hidden
            return n, n
        n += d * moe.num_experts  # router
        n += moe.num_shared_experts * 3 * d * moe.shared_hidden
        routed_per_expert = 3 * d * moe.expert_hidden
        return n + moe.num_experts * routed_per_expert, n + moe.top_k * routed_per_expert

    layers_total = layers_active = 0
    for i, attention_type in enumerate(cfg.layout):
        total, active = block(attention_type, is_moe=i >= cfg.num_dense_layers)
        layers_total, layers_active = layers_total + total, layers_active + active

    embeddings = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else d * cfg.vocab_size
    final_norm = d
    # a `layer` block is an MoE layer (no mHC here); its e_proj + h_proj have eh_proj's size
    mtp_block = block("S", is_moe=cfg.mtp.block == "layer")
    mtp_rest = (2 * d  # enorm, hnorm
                + 2 * d * d  # eh_proj
                + d  # the head's final norm
                + (0 if cfg.mtp.share_output_head else d * cfg.vocab_size))
    mtp, mtp_active = (cfg.mtp.num_heads * (mtp_rest + n) for n in mtp_block)
    counts = {
        "total": embeddings + layers_total + final_norm + head,
        "active": embeddings + layers_active + final_norm + head,
        "total_excl_embeddings": layers_total + final_norm,
        "active_excl_embeddings": layers_active + final_norm,
    }
    return {**counts, "mtp": mtp, "mtp_active": mtp_active,
            "with_mtp": {k: v + (mtp_active if k.startswith("active") else mtp)
                         for k, v in counts.items()}}


@pytest.mark.parametrize("overrides", [
    [],
    ["scan_layers=false"],
    # The other branches: sink logits, no q/k norm, tied embeddings, MTP sharing the main head,
    # no shared expert, a different top-k.
    ["gate=sink", "qk_norm=false", "tie_embeddings=true", "mtp.share_output_head=true",
     "moe.num_shared_experts=0", "moe.top_k=2", "mtp.num_heads=1"],
    ["mtp.block=layer", "mtp.num_heads=2"],  # DeepSeek-V4's MTP block: an MoE layer
])
def test_tiny_matches_hand_count(overrides):
    cfg = load_config(TINY, overrides)
    counts = count_params(cfg)
    assert {k: v for k, v in counts.items() if k != "breakdown"} == hand_count(cfg)
    breakdown = counts["breakdown"]
    assert breakdown["other"]["total"] == 0
    assert sum(g["total"] for g in breakdown.values()) == counts["with_mtp"]["total"]
    assert sum(g["active"] for g in breakdown.values()) == counts["with_mtp"]["active"]


@pytest.mark.parametrize("overrides", [[], ["scan_layers=false", "mtp.share_output_head=true"]])
def test_tiny_mimo_matches_hand_count(overrides):
    """Per-type KV heads (1 full / 2 SWA), values narrower than keys, the sink on SWA only."""
    cfg = load_config(TINY_MIMO, overrides)
    counts = count_params(cfg)
    assert {k: v for k, v in counts.items() if k != "breakdown"} == hand_count(cfg)
    assert counts["breakdown"]["other"]["total"] == 0


def test_mimo_v2_flash_matches_the_report():
    """MiMo-V2-Flash report: 309B total / 15B active (the backbone with embeddings and output
    head, without MTP, as DeepSeek-V3 counts), 0.33B per MTP block."""
    cfg = load_config(MIMO)
    counts = count_params(cfg)
    assert {k: v for k, v in counts.items() if k != "breakdown"} == hand_count(cfg)
    assert [round(counts[k] / 1e9) for k in ("total", "active")] == [309, 15]
    assert counts["total"] == pytest.approx(309e9, rel=0.002)
    assert counts["active"] == pytest.approx(15e9, rel=0.035)
    # One MTP block by hand: eh_proj [2d, d]; SWA attention q [d, 64*192], k [d, 8*192],
    # v [d, 8*128], o [64*128, d] and 64 sink logits; the dense FFN 3 x [d, 16384]; enorm,
    # hnorm, the block's two norms and its final norm; no output head of its own.
    d = 4096
    block = (2 * d * d + d * 64 * 192 + d * 8 * 192 + d * 8 * 128 + 64 * 128 * d + 64
             + 3 * d * 16384 + 5 * d)
    assert counts["mtp"] == 3 * block and round(block / 1e9, 2) == 0.33
    # Routed experts dominate: 47 MoE layers x 256 experts x 3 x [4096, 2048].
    assert counts["breakdown"]["moe_routed"]["total"] == 47 * 256 * 3 * d * 2048


def test_scan_on_and_off_agree():
    assert count_params(load_config(TINY, ["scan_layers=true"])) == count_params(
        load_config(TINY, ["scan_layers=false"]))


def test_step35_flash_matches_table6():
    counts = count_params(load_config(STEP35))
    backbone_total = counts["total_excl_embeddings"]
    backbone_active = counts["active_excl_embeddings"]
    with_mtp = counts["with_mtp"]
    # Table 6: 196B / 11B (backbone), 198B / 13B (with MTP3), printed as whole billions.
    assert backbone_total == pytest.approx(196e9, rel=0.01)
    assert backbone_active == pytest.approx(11e9, rel=0.03)
    assert with_mtp["total_excl_embeddings"] == pytest.approx(198e9, rel=0.01)
    assert with_mtp["active_excl_embeddings"] == pytest.approx(13e9, rel=0.04)
    assert [round(n / 1e9) for n in (backbone_total, backbone_active,
                                     with_mtp["total_excl_embeddings"],
                                     with_mtp["active_excl_embeddings"])] == [196, 11, 198, 13]
    assert counts["mtp"] / 3 == pytest.approx(0.81e9, rel=0.01)  # one MTP head incl. its head


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "model.summary", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_json():
    proc = run_cli("--config", TINY, "--json", "moe.top_k=2")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"total", "active", "total_excl_embeddings", "active_excl_embeddings", "mtp",
            "with_mtp", "breakdown"} <= out.keys()
    expected = hand_count(load_config(TINY, ["moe.top_k=2"]))
    assert {k: out[k] for k in expected} == expected


def test_cli_missing_config_is_one_line_exit_2():
    proc = run_cli("--config", "no/such.yaml")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "no/such.yaml" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, needle", [
    (["--config", TINY, "bogus=1"], "bogus"),
    (["--config", TINY, "moe.top_k=99"], "moe.top_k"),
    (["--config", TINY, "d_model"], "key=value"),
    ([TINY], "--config"),
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
    assert "active" in capsys.readouterr().out
    assert main(["--config", TINY]) == 0
    table = capsys.readouterr().out
    assert "moe_routed" in table and "with MTP" in table
