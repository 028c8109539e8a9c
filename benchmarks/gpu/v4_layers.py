"""Section `v4_layers` of `make gpu-check`: DeepSeek-V4's attention layers on the device, forward +
backward of whole layers (projections, compressor, lightning indexer with its KL loss, the
compressed-attention core; benchmarks.compressed_attention_scaling.model_layer_step) of
configs/gpu_1b_deepseek_v4.yaml (16 heads of 512, W = 128, CSA rate 4 with top-512, HCA rate
128), batch 1, against the full-attention layer of configs/gpu_1b.yaml (the same d_model,
`attention_impl=pallas`). Cases run in order until the section's deadline: 16k first (the
target's length), then CSA at the other lengths (how its time grows), then the rest.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.common import time_compiled
from benchmarks.compressed_attention_scaling import model_layer_step
from benchmarks.gpu.checks import first_line
from model.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
V4_CONFIG, DENSE_CONFIG = CONFIGS / "gpu_1b_deepseek_v4.yaml", CONFIGS / "gpu_1b.yaml"
TARGET_LENGTH = 16384
CSA_VS_DENSE = 0.5
CSA_GROWTH = (8192, 65536, 9.0)  # time(64k) / time(8k) <= 9 (linear: 8)


def layer_config(kind: str, dry_run: bool):
    """The model config of a layer kind ("C", "H", "W" or "dense"); the dry run shrinks it."""
    shrink = (["d_model=64", "shared_kv_attention.num_heads=2", "shared_kv_attention.head_dim=64",
               "shared_kv_attention.q_lora_rank=32", "shared_kv_attention.o_lora_rank=32",
               "shared_kv_attention.o_groups=2", "shared_kv_attention.index_heads=2",
               "shared_kv_attention.index_head_dim=32", "shared_kv_attention.index_topk=8",
               "shared_kv_attention.rope_dims=16", "shared_kv_attention.hca_rate=16",
               "window=16", "compute_dtype=float32"] if dry_run else [])
    if kind == "dense":
        dense = ["d_model=64", "head_dim=16", "compute_dtype=float32", "attention_impl=xla"]
        return load_config(DENSE_CONFIG, dense if dry_run else [])
    return load_config(V4_CONFIG, shrink)


def run_v4_layers(cases: list[tuple[int, str]], *, dry_run: bool, repeats: int,
                  deadline: float) -> dict:
    records = []
    for length, kind in cases:
        record = {"length": length, "kind": kind}
        if time.monotonic() > deadline:
            records.append({**record, "status": "skipped", "note": "section time limit reached"})
            continue
        try:
            compiled, args = model_layer_step(layer_config(kind, dry_run), kind, length)
            record.update(status="done", fwd_bwd_ms=1e3 * time_compiled(compiled, *args,
                                                                        repeats=repeats))
        except Exception as err:  # e.g. out of memory at 64k
            record.update(status="error", note=first_line(err))
        records.append(record)
    return {"status": "done", "records": records}


def v4_targets(sections: dict) -> list[dict]:
    times = {(r["length"], r["kind"]): r["fwd_bwd_ms"]
             for r in sections.get("v4_layers", {}).get("records", []) if r["status"] == "done"}
    csa, dense = times.get((TARGET_LENGTH, "C")), times.get((TARGET_LENGTH, "dense"))
    ratio = csa / dense if csa and dense else None
    short, long, goal = CSA_GROWTH
    growth = (times[(long, "C")] / times[(short, "C")]
              if (long, "C") in times and (short, "C") in times else None)
    return [
        {"target": f"DeepSeek-V4 CSA layer / dense full-attention layer at {TARGET_LENGTH}, "
                   "fwd+bwd", "value": ratio, "goal": f"<= {CSA_VS_DENSE}",
         "met": None if ratio is None else ratio <= CSA_VS_DENSE},
        {"target": f"CSA layer time({long // 1024}k)/time({short // 1024}k)", "value": growth,
         "goal": f"<= {goal:g}", "met": None if growth is None else growth <= goal},
    ]
