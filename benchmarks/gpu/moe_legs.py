"""The per-leg grouped-matmul sweep of `make gpu-check` (benchmarks.gpu.suite): which kernel and
configuration runs each leg of the MoE's expert matmuls fastest on this device.

For each expert matmul of the train config's model (gate/up fused: [M, D] x [E, D, 2F]; down:
[M, F] x [E, F, D]) and each leg (fwd, dx, dw: `pallas_kernels.grouped_legs`), at most 8
candidates (`CANDIDATES`: Mosaic GPU blocks, Triton tiles, lax.ragged_dot) run on operands of
the timed MoE layer's rows (M = tokens x top_k, balanced random group sizes, the timing dtype).
Each candidate is compiled, checked against `lax.ragged_dot` with float32 accumulation (relative
error at most TOLERANCE: a kernel that computes the wrong thing never wins), then timed (median
of `repeats` calls). Candidates run round-robin over the (matmul, leg) pairs in their listed
order, so a section deadline cuts the least likely ones everywhere. A configuration that needs
more shared memory than the device has is refused when it is compiled and recorded as skipped.

The fastest correct candidate of each (matmul, leg) becomes a `grouped_leg_table.Row`; the
section writes DIR/grouped_leg_table.json (copy it to pallas_kernels/ to adopt it), and on an
accelerator the rows serve the rest of the run, so the train step measures the chosen kernels.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import markdown_table, time_compiled
from benchmarks.gpu.checks import first_line, relative_errors
from model.ops.pallas_moe import expert_matmuls, expert_plan, leg_widths
from pallas_kernels import grouped_leg_table, mosaic_gpu
from pallas_kernels.grouped_common import Tiling, resolve_interpret
from pallas_kernels.grouped_legs import LEGS, LegChoice, grouped, transposed
from pallas_kernels.grouped_matmul_mgpu import Blocks

TOLERANCE = 5e-2  # bfloat16 outputs of float32 accumulations, max-relative
# Mosaic GPU blocks within upstream's own sweep (block_m, block_n in 64-192, block_k 64, 2-6
# stages), at most 227 KiB of shared memory, block_m dividing typical row counts (multiples of
# 128: no padding) and block_n x grid_block_n dividing gpu_1b's widths (512, 1024, 1536).
_MOSAIC_GMM = (Blocks(128, 128, 64, 4, 1), Blocks(128, 128, 64, 4, 4), Blocks(128, 128, 64, 5, 2),
               Blocks(64, 128, 64, 5, 2), Blocks(128, 64, 64, 6, 2))
# The rule's choice first (grouped_leg_table.rule), lax.ragged_dot (XLA's dense expansion) last.
CANDIDATES = {
    "fwd": (*(LegChoice("mosaic_gpu", b) for b in _MOSAIC_GMM),
            LegChoice("triton", Tiling(128, 64, 128)), LegChoice("triton", Tiling(64, 64, 128)),
            LegChoice("xla")),
    "dx": (*(LegChoice("mosaic_gpu", b) for b in _MOSAIC_GMM),
           LegChoice("triton", Tiling(128, 64, 128)), LegChoice("triton", Tiling(128, 128, 64)),
           LegChoice("xla")),
    "dw": (LegChoice("triton", Tiling(128, 64, 128)), LegChoice("triton", Tiling(64, 128, 128)),
           LegChoice("triton", Tiling(128, 128, 64)),
           LegChoice("mosaic_gpu", Blocks(128, 128, 64, 4, 1)),
           LegChoice("mosaic_gpu", Blocks(128, 128, 128, 2, 1)),
           LegChoice("mosaic_gpu", Blocks(64, 128, 64, 4, 2)),
           LegChoice("mosaic_gpu", Blocks(128, 64, 128, 4, 1)), LegChoice("xla")),
}
NATIVE = {"mosaic_gpu": "gpu", "triton": "gpu", "mosaic_tpu": "tpu"}  # backend -> platform


def skip_reason(choice: LegChoice, leg: str, backend: str) -> str | None:
    """Why a candidate does not run here, or None; on CPU Pallas runs interpreted."""
    if (choice.backend, leg) in grouped_leg_table.UNAVAILABLE:
        return grouped_leg_table.UNAVAILABLE[(choice.backend, leg)]
    platform = NATIVE.get(choice.backend)
    if platform is None or backend == "cpu" and choice.backend != "mosaic_gpu":
        return None
    if choice.backend == "mosaic_gpu" and not mosaic_gpu.hopper_available():
        return "needs an NVIDIA Hopper GPU (sm90) with Mosaic GPU"
    return None if backend == platform else f"a {platform} kernel"


def operands(leg: str, rows: int, k: int, n: int, experts: int, dtype, seed: int) -> tuple:
    """(lhs, rhs, group_sizes) of one leg call; balanced random group sizes."""
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(rows, np.full(experts, 1.0 / experts)).astype(np.int32)
    rhs_shape = {"fwd": (experts, k, n), "dx": (experts, n, k), "dw": (rows, n)}[leg]
    lhs = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal(rhs_shape) / np.sqrt(k), dtype)
    return lhs, rhs, jnp.asarray(sizes)


def leg_call(leg: str, choice: LegChoice):
    """The jitted leg on `choice`'s kernels: (lhs, rhs, group_sizes) -> output."""
    if leg == "dw":
        return jax.jit(lambda lhs, rhs, sizes: transposed(choice, lhs, rhs, sizes))
    return jax.jit(lambda lhs, rhs, sizes: grouped(choice, lhs, rhs, sizes,
                                                   transpose_rhs=leg == "dx"))


def relative_error(got, want) -> float:
    """max|got - want| / max|want| (the checks' measure)."""
    return relative_errors({"out": got}, {"out": want})["out"]


def _measure(leg, choice, args, want, repeats) -> dict:
    try:
        compiled = leg_call(leg, choice).lower(*args).compile()
    except ValueError as err:
        if "exceeds available shared memory" in str(err):
            return {"status": "skipped", "note": "exceeds the device's shared memory"}
        raise
    error = relative_error(compiled(*args), want)
    if not error <= TOLERANCE:
        return {"status": "wrong", "error": error, "note": f"relative error {error:.2e}"}
    return {"status": "done", "error": error,
            "seconds": time_compiled(compiled, *args, repeats=repeats)}


def sweep(model, *, rows: int, dtype, repeats: int, backend: str, peak_tflops: float | None,
          deadline: float, candidates: dict = CANDIDATES) -> dict:
    """The section record: every candidate's record and the chosen `Row`s."""
    device = grouped_leg_table.current_device()
    experts = model.moe.num_experts
    pairs = [(matmul, leg, *leg_widths(*widths)[leg])
             for matmul, widths in expert_matmuls(model.d_model, model.moe.expert_hidden).items()
             for leg in LEGS]
    inputs, wants, records = {}, {}, []
    for rank in range(max(len(c) for c in candidates.values())):
        for seed, (matmul, leg, k, n) in enumerate(pairs):
            if rank >= len(candidates[leg]):
                continue
            choice = candidates[leg][rank]
            record = {"matmul": matmul, "leg": leg, "k": k, "n": n, "backend": choice.backend,
                      "config": None if choice.config is None else list(choice.config)}
            reason = skip_reason(choice, leg, backend)
            if reason is None and time.monotonic() > deadline:
                reason = "section time limit reached"
            if reason:
                records.append({**record, "status": "skipped", "note": reason})
                continue
            key = (matmul, leg)
            try:
                if key not in inputs:
                    inputs[key] = operands(leg, rows, k, n, experts, dtype, seed)
                    wants[key] = leg_call(leg, LegChoice("xla"))(*inputs[key])
                record.update(_measure(leg, choice, inputs[key], wants[key], repeats))
            except Exception as err:  # one broken candidate must not cost the others
                record.update(status="error", note=first_line(err))
            if backend == "cpu" and choice.backend in NATIVE and record["status"] == "done":
                record["note"] = "interpret mode: its time is not a performance figure"
            if "seconds" in record:
                tflops = 2 * rows * k * n / record["seconds"] / 1e12
                record.update(ms=record.pop("seconds") * 1e3, tflops=tflops,
                              of_peak=tflops / peak_tflops if peak_tflops else None)
            records.append(record)
    chosen = chosen_rows(records, device, jnp.dtype(dtype).name)
    return {"status": "done", "rows": rows, "dtype": jnp.dtype(dtype).name,
            "peak_tflops": peak_tflops, "records": records,
            "chosen": [row._asdict() for row in chosen]}


def chosen_rows(records: list[dict], device, dtype: str) -> list:
    """The fastest correct candidate of each (matmul, leg) as a table row."""
    best = {}
    for r in records:
        key = (r["matmul"], r["leg"])
        if r["status"] == "done" and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    stamp = datetime.date.today().isoformat()
    return [grouped_leg_table.Row(device.kind, device.jax, dtype, r["leg"], r["k"], r["n"],
                                  r["backend"], None if r["config"] is None else
                                  tuple(r["config"]), round(r["tflops"], 1),
                                  f"make gpu-check {stamp}") for r in best.values()]


def write_table(section: dict, out_dir: Path, device: str) -> Path:
    """DIR/grouped_leg_table.json: the committed table with the chosen rows in place."""
    rows = [grouped_leg_table.Row.from_json(row) for row in section["chosen"]]
    status = (f"measured on {device} by make gpu-check {datetime.date.today().isoformat()} "
              f"({section['rows']} rows, {section['dtype']}); rows of other devices as committed")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / "grouped_leg_table.json"
    path.write_text(json.dumps(grouped_leg_table.merged_table(rows, status), indent=1) + "\n")
    return path


def plan_of(model) -> dict[str, dict[str, str]]:
    """The kernels `moe_impl=pallas` runs for `model` here: matmul -> leg -> "backend config"."""
    plan = expert_plan(None, model.d_model, model.moe.expert_hidden, model.compute_dtype,
                       model.moe.block_size, resolve_interpret(None))
    return {matmul: {leg: f"{c.backend} {tuple(c.config) if c.config else ''}".strip()
                     for leg, c in legs._asdict().items()}
            for matmul, legs in plan._asdict().items()}


def run_legs(ctx, deadline: float) -> dict:
    """The section runner (benchmarks.gpu.suite): rows of the timed MoE layer, timing dtype."""
    plan, model = ctx.plan, ctx.model
    section = sweep(model, rows=plan.moe_tokens * model.moe.top_k, dtype=plan.timing_dtype,
                    repeats=plan.legs_repeats, backend=ctx.backend,
                    peak_tflops=ctx.peak_tflops, deadline=deadline,
                    candidates=plan.legs_candidates or CANDIDATES)
    if section["chosen"]:
        path = write_table(section, ctx.shared["out_dir"], jax.devices()[0].device_kind)
        section["table"] = str(path)
    if ctx.backend != "cpu" and section["chosen"]:
        grouped_leg_table.install(grouped_leg_table.Row.from_json(row)
                                  for row in section["chosen"])
        section["note"] = "the chosen rows serve the later sections of this run"
    return section


def markdown(section: dict) -> list[str]:
    def num(value, digits=3):
        return "-" if value is None else f"{value:.{digits}g}"

    rows = [[r["matmul"], f"{r['k']}x{r['n']}", r["leg"], r["backend"],
             "-" if r["config"] is None else str(tuple(r["config"])), r["status"],
             num(r.get("ms")), num(r.get("tflops")),
             "-" if r.get("of_peak") is None else f"{100 * r['of_peak']:.1f}%", r.get("note", "")]
            for r in section.get("records", [])]
    lines = [f"rows (routed copies) {section.get('rows')}, {section.get('dtype')}", "",
             markdown_table(["matmul", "k x n", "leg", "backend", "config", "status", "ms",
                             "TFLOP/s", "of peak", "note"], rows)]
    if section.get("chosen"):
        chosen = [[r["leg"], f"{r['k']}x{r['n']}", r["backend"],
                   "-" if r["config"] is None else str(tuple(r["config"])), num(r["tflops"])]
                  for r in section["chosen"]]
        lines += ["", f"Chosen, written to {section.get('table')} (copy it to "
                  "pallas_kernels/grouped_leg_table.json to adopt it):", "",
                  markdown_table(["leg", "k x n", "backend", "config", "TFLOP/s"], chosen)]
    return lines
