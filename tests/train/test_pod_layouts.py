"""The three families at their reports' scale plan within 80 GB cards on the layouts that
docs/parallelism.md ("The reports' layouts") justifies, with the presets' own defaults."""

import json
from pathlib import Path

import pytest

from model.config import load_config
from model.layers.layer_plan import LayerKind
from model.parallel.expert_parallel import exchange_chunk
from train.parallel.exchange_plan import exchange_bytes, exchange_tokens, routed_rows_bytes
from train.parallel.plan import main

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
LAYOUTS = {
    "step35_flash": ["--mesh", "pipeline=8,expert=8,data=64", "--batch-size", "16384",
                     "--seq-len", "4096", "model.pipeline_microbatches=32",
                     "model.pipeline_virtual_stages=2"],
    "deepseek_v4_flash": ["--mesh", "pipeline=4,expert=16,data=32", "--batch-size", "18432",
                          "--micro-batch-size", "2048", "--seq-len", "4096",
                          "model.pipeline_microbatches=8", "model.pipeline_virtual_stages=5"],
    "mimo_v2_flash": ["--mesh", "pipeline=4,expert=16,data=32", "--batch-size", "2048",
                      "--seq-len", "32768", "model.pipeline_microbatches=4",
                      "model.pipeline_virtual_stages=2"],
}


def plan_total(capsys, preset: str, *extra: str) -> float:
    argv = ["--config", str(ROOT / "configs" / f"{preset}.yaml"), *LAYOUTS[preset], *extra,
            "--device-memory", "80", "--json"]
    main(argv)
    return json.loads(capsys.readouterr().out)["per_device_bytes"]["total"] / GIB


@pytest.mark.parametrize("preset", sorted(LAYOUTS))
def test_report_layout_fits_80_gb_and_strict_exits_0(capsys, preset):
    argv = ["--config", str(ROOT / "configs" / f"{preset}.yaml"), *LAYOUTS[preset],
            "--device-memory", "80", "--strict"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "within budget" in capsys.readouterr().out


def test_step35_needs_the_chunked_exchange(capsys):
    # all of a layer's 16,384 tokens per device at once: the dropless receive buffers of the
    # layers outside the pipeline hold 8 peers x 16,384 x 8 copies
    assert plan_total(capsys, "step35_flash", "model.moe.ep_chunk_tokens=0") > 80
    assert plan_total(capsys, "step35_flash") < 80


def test_exchange_terms_by_hand():
    cfg = load_config(str(ROOT / "configs" / "step35_flash.yaml"))  # D 4096, F 1280, k 8
    moe_layer = LayerKind("S", True, 0.0, 0.0, False)
    sizes = {"pipeline": 1, "data": 2, "fsdp": 1, "expert": 8, "tensor": 1}
    # ep_chunk_tokens 4,096: a device holding 16,384 tokens exchanges them 4,096 at a time
    assert exchange_tokens(cfg, 16384, sizes) == 4096
    assert exchange_tokens(cfg, 2048, sizes) == 2048
    assert exchange_tokens(cfg, 16384, dict.fromkeys(sizes, 1)) == 16384  # no exchange
    # per exchanged token: 8 peers x 8 copies of the bf16 layer input + output, gate, up and
    # activation on the receive buffer; the ragged exchange's landing buffer of 8 x 8 rows of D
    assert routed_rows_bytes(cfg, moe_layer, 1, 8) == 8 * 8 * 2 * (2 * 4096 + 3 * 1280)
    assert routed_rows_bytes(cfg, LayerKind("S", False, 0.0, 0.0, False), 1, 8) == 0
    assert exchange_bytes(cfg.replace(ep_collective="ragged"), moe_layer, 8) == 8 * 8 * 2 * 4096


def test_exchange_chunk_is_the_largest_divisor_not_above_the_setting():
    assert exchange_chunk(16384, 4096) == 4096
    assert exchange_chunk(6144, 4096) == 3072  # 3 rows of 2,048: 2 exchanges, not a ragged 3rd
    assert exchange_chunk(2048, 4096) == 2048 and exchange_chunk(2048, 0) == 2048
    assert exchange_chunk(13, 4) == 1  # a prime count: one token at a time
