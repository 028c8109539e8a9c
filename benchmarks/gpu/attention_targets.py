"""The attention targets of `make gpu-check` (benchmarks.gpu.report), from the attention
section's records (batch 1, bfloat16, the train config's SWA and full layers):

- full attention fwd+bwd at 8192 / bf16 peak, best implementation: >= 0.35;
- Mosaic GPU flash attention speed / cuDNN at 8192, full causal (cuDNN's time divided by
  ours, `pallas` where it ran the Mosaic GPU kernels): >= 0.8;
- SWA time(32k) / time(4k) of `pallas`: <= 9 (linear in T would be 8).
"""

from __future__ import annotations

FULL_LENGTH = 8192
PEAK_SHARE = 0.35
MOSAIC_VS_CUDNN = 0.8
SWA_GROWTH = 9.0
SWA_LENGTHS = (4096, 32768)


def _done(sections: dict) -> list[dict]:
    return [r for r in sections.get("attention", {}).get("records", [])
            if r.get("status") == "done"]


def _target(name: str, value, goal: str, met) -> dict:
    return {"target": name, "value": value, "goal": goal,
            "met": None if value is None else met(value)}


def attention_targets(sections: dict) -> list[dict]:
    records = _done(sections)
    full = {r["impl"]: r for r in records if r["kind"] == "full" and r["length"] == FULL_LENGTH}
    shares = [r["of_peak"] for r in full.values() if r.get("of_peak") is not None]
    best = max(shares) if shares else None
    ours = full.get("pallas")
    mosaic = ours if ours and ours.get("note") == "Mosaic GPU" else None
    speed = (full["cudnn"]["fwd_bwd_ms"] / mosaic["fwd_bwd_ms"]
             if mosaic and "cudnn" in full else None)
    swa = {r["length"]: r["fwd_bwd_ms"] for r in records
           if r["kind"] == "swa" and r["impl"] == "pallas"}
    short, long = SWA_LENGTHS
    growth = swa[long] / swa[short] if short in swa and long in swa else None
    return [
        _target(f"full attention fwd+bwd at {FULL_LENGTH} / bf16 peak (best implementation)",
                best, f">= {PEAK_SHARE}", lambda v: v >= PEAK_SHARE),
        _target(f"Mosaic GPU flash attention speed / cuDNN at {FULL_LENGTH}, full causal "
                "(cuDNN time / ours)", speed, f">= {MOSAIC_VS_CUDNN}",
                lambda v: v >= MOSAIC_VS_CUDNN),
        _target("SWA time(32k)/time(4k), pallas", growth, f"<= {SWA_GROWTH:g}",
                lambda v: v <= SWA_GROWTH),
    ]
