"""Section `attention_sweep` of `make gpu-check`: block sizes of the Mosaic GPU flash attention
(pallas_kernels/flash_attention_blocks.py) timed on the device in one call.

Each candidate (forward, dq, dk/dv blocks, at most `MAX_CANDIDATES`) runs forward + backward
of the train config's full layer (full causal) and SWA layer at `LENGTH` tokens, batch 1,
bfloat16; the candidate with the least summed time wins. The section writes
DIR/flash_attention_blocks.json: the committed table with the swept head dims' entry replaced
by the winner and its device and date recorded; copy it over
pallas_kernels/flash_attention_blocks.json to adopt it. Runs only where the Mosaic GPU kernels
do (sm90); elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import time
from pathlib import Path

import jax.numpy as jnp

from benchmarks.gpu.checks import first_line
from benchmarks.gpu.timings import AttentionShape, attention_seconds
from pallas_kernels.flash_attention_blocks import KERNELS, load_table
from pallas_kernels.mgpu_attention_common import Blocks

LENGTH = 8192
MAX_CANDIDATES = 8
# (forward, dq, dkv) Blocks(block, stream, compute warpgroups, stages); the first is the
# committed default. All fit sm90's shared memory at D = 128 (see the tests).
CANDIDATES = (
    (Blocks(64, 128), Blocks(64, 64), Blocks(64, 64)),
    (Blocks(64, 64), Blocks(64, 64), Blocks(64, 64)),
    (Blocks(64, 64, 2, 3), Blocks(64, 64), Blocks(64, 64)),
    (Blocks(64, 128), Blocks(64, 128), Blocks(64, 64)),
    (Blocks(64, 128), Blocks(64, 64), Blocks(64, 128)),
    (Blocks(64, 128), Blocks(64, 128), Blocks(64, 128)),
    (Blocks(64, 128), Blocks(64, 64, 1), Blocks(64, 64, 1)),
)
assert len(CANDIDATES) <= MAX_CANDIDATES


def skip_reason(backend: str, capability) -> str | None:
    from pallas_kernels.gpu_arch import is_hopper
    if backend != "gpu" or not is_hopper(capability):
        return "the Mosaic GPU kernels need an sm90 GPU (H100/H200)"
    return None


def chosen_table(winner, head_dims: tuple[int, int], device: str) -> dict:
    table = json.loads(json.dumps(load_table()))  # a copy
    key = f"{head_dims[0]}x{head_dims[1]}"
    table["entries"][key] = {name: list(dataclasses.astuple(blocks))
                             for name, blocks in zip(KERNELS, winner)}
    table["status"] = f"measured: entry {key} swept on {device} at T = {LENGTH}, batch 1, bf16"
    table["device"] = device
    table["measured"] = datetime.date.today().isoformat()
    return table


def run_attention_sweep(shapes: list[AttentionShape], *, backend: str, capability, device: str,
                        out_dir: Path, deadline: float, repeats: int = 3) -> dict:
    reason = skip_reason(backend, capability)
    if reason:
        return {"status": "skipped", "note": reason}
    records = []
    for index, blocks in enumerate(CANDIDATES):
        record = {"candidate": index, "blocks": {n: str(b) for n, b in zip(KERNELS, blocks)}}
        if time.monotonic() > deadline:
            records.append({**record, "status": "skipped", "note": "section time limit reached"})
            continue
        core = functools.partial(_with_blocks, blocks=blocks)
        try:
            record["ms"] = {shape.kind: 1e3 * attention_seconds(
                "pallas", shape, LENGTH, 1, jnp.bfloat16, repeats, core=core) for shape in shapes}
            record.update(status="done", total_ms=sum(record["ms"].values()))
        except Exception as err:  # e.g. a candidate that does not compile
            record.update(status="error", note=first_line(err))
        records.append(record)
    done = [r for r in records if r["status"] == "done"]
    if not done:
        return {"status": "failed", "records": records, "note": "no candidate ran"}
    best = min(done, key=lambda r: r["total_ms"])
    head_dims = (shapes[0].head_dim, shapes[0].head_dim)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / "flash_attention_blocks.json"
    path.write_text(json.dumps(chosen_table(CANDIDATES[best["candidate"]], head_dims, device),
                               indent=2) + "\n")
    return {"status": "done", "length": LENGTH, "records": records, "chosen": best["candidate"],
            "table": str(path)}


def _with_blocks(q, k, v, *, window, segment_ids, sink, blocks):
    from pallas_kernels.flash_attention_mgpu import mgpu_flash_attention
    return mgpu_flash_attention(q, k, v, window=window, segment_ids=segment_ids, sink=sink,
                                blocks=blocks)


def sweep_table(records: list[dict]) -> list[list]:
    """Rows of the report's sweep table."""
    return [[r["candidate"], *(r["blocks"][n] for n in KERNELS),
             *(f"{r['ms'][k]:.3g}" if r.get("ms") and k in r["ms"] else "-"
               for k in ("full", "swa")), r["status"], r.get("note", "")]
            for r in records]

