"""`gpu_report.json` and `gpu_report.md` of `make gpu-check` (benchmarks.gpu.suite): the device,
the versions, every section's records and the targets, as data and as tables."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu import attention_report
from benchmarks.gpu import moe_legs, profiling
from benchmarks.common import markdown_table
from benchmarks.gpu.attention_targets import attention_targets
from benchmarks.gpu.training import remat_markdown
from benchmarks.gpu.v4_layers import v4_targets

# The GPU run's targets, checked from the section records (`targets`).
MFU_TARGET = 0.30  # train step of the ~1B config (aim: 0.45)
PALLAS_SWA_LENGTH = 16384  # Pallas SWA at least as fast as the best of xla / cudnn there
MOE_VS_DENSE = 1.5  # the MoE layer (moe_impl=pallas) against a dense FFN of equal active FLOPs
LEG_OF_PEAK = 0.5  # each chosen grouped matmul leg at gpu_1b shapes, of the bf16 peak


def _num(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def targets(sections: dict, device_run: bool) -> list[dict]:
    """Each target: its value, the goal and whether it is met (None: not measured, or a dry
    run, whose tiny shapes say nothing about the targets)."""
    out = []
    train = sections.get("train", {})
    mfu = train.get("mfu")
    out.append({"target": "train-step MFU (bf16 peak)", "value": mfu, "goal": f">= {MFU_TARGET}",
                "met": None if mfu is None else mfu >= MFU_TARGET})
    swa = {r["impl"]: r["fwd_bwd_ms"] for r in sections.get("attention", {}).get("records", [])
           if r.get("status") == "done" and r["kind"] == "swa"
           and r["length"] == PALLAS_SWA_LENGTH}
    others = [swa[i] for i in ("xla", "cudnn") if i in swa]
    ratio = swa["pallas"] / min(others) if "pallas" in swa and others else None
    out.append({"target": f"Pallas SWA fwd+bwd at {PALLAS_SWA_LENGTH} / best of xla, cudnn",
                "value": ratio, "goal": "<= 1.0", "met": None if ratio is None else ratio <= 1.0})
    moe = {r["impl"]: r for r in sections.get("moe", {}).get("records", [])
           if r.get("status") == "done"}
    vs_dense = moe["pallas"]["vs_dense"] if "pallas" in moe else None
    out.append({"target": "MoE layer fwd+bwd / dense FFN of equal active FLOPs (moe_impl=pallas)",
                "value": vs_dense, "goal": f"<= {MOE_VS_DENSE}",
                "met": None if vs_dense is None else vs_dense <= MOE_VS_DENSE})
    for row in sections.get("legs", {}).get("chosen", []):
        peak = sections["legs"].get("peak_tflops")
        share = row["tflops"] / peak if peak else None
        out.append({"target": f"grouped matmul {row['leg']} {row['k']}x{row['n']} TFLOP/s "
                              f"(chosen: {row['backend']})", "value": row["tflops"],
                    "goal": f">= {LEG_OF_PEAK:.0%} of peak",
                    "met": None if share is None else share >= LEG_OF_PEAK})
    out += attention_targets(sections) + v4_targets(sections)
    if not device_run:
        out = [{**t, "met": None} for t in out]
    return out


def _checks_table(records: list[dict]) -> str:
    rows = []
    for r in records:
        errors = r.get("errors") or {}
        worst = max(errors, key=errors.get) if errors else None
        rows.append([r["table"], r["impl"], r["case"], r["dtype"], r["status"],
                     f"{worst} {errors[worst]:.2e}" if worst else "-",
                     f"{r['tolerance']:.0e}", r.get("note", ""), r.get("shape", "")])
    return markdown_table(["table", "impl", "case", "dtype", "status", "max error (worst array)",
                           "tolerance", "note", "shape"], rows)


def _attention_table(records: list[dict]) -> str:
    rows = [[r["length"], r["kind"], r["impl"], r["status"], _num(r.get("fwd_bwd_ms")),
             _num(r.get("tflops")), _pct(r.get("of_peak")), r.get("note", "")]
            for r in records]
    return markdown_table(["T", "kind", "impl", "status", "fwd+bwd ms", "TFLOP/s", "of peak",
                           "note"], rows)


def _moe_table(records: list[dict]) -> str:
    rows = [[r["impl"], r["status"], _num(r.get("fwd_bwd_ms")), _num(r.get("gflops")),
             _num(r.get("vs_dense")), r.get("note", "")] for r in records]
    return markdown_table(["impl", "status", "fwd+bwd ms", "GFLOP/s", "vs dense", "note"], rows)


def _train_lines(train: dict) -> list[str]:
    if train.get("status") != "done":
        return [f"- {_kernels(f)}: {f['error']}" for f in train.get("failed", [])]
    keys = ["config", "attention_impl", "moe_impl", "remat_policy", "compute_dtype", "optimizer",
            "params", "active_params", "tokens_per_step", "compile_s", "step_s_median",
            "tokens_per_s", "achieved_tflops", "mfu", "loss_first", "loss_last",
            "step_scratch_gib", "planner_activations_gib", "planner_gradients_gib",
            "planner_total_gib", "process_peak_gib", "limit_gib"]
    rows = [[k, _pct(train[k]) if k == "mfu" else _num(train.get(k), 4)] for k in keys]
    rows += [[f"moe kernels, {matmul}", ", ".join(f"{leg}: {kernel}" for leg, kernel in
                                                  legs.items())]
             for matmul, legs in (train.get("moe_legs") or {}).items()]
    lines = [markdown_table(["quantity", "value"], rows)]
    lines += [f"- failed first with {_kernels(f)}: {f['error']}" for f in train.get("failed", [])]
    return lines


def _kernels(attempt: dict) -> str:
    return f"attention_impl={attempt['attention_impl']}, moe_impl={attempt['moe_impl']}"


SECTION_TITLES = {"checks": "Correctness against the XLA reference",
                  "legs": "Grouped matmuls per leg (MoE experts)",
                  "attention": "Attention forward + backward",
                  "moe": "MoE layer forward + backward", "train": "Train step",
                  "profile": "Where the train step's time goes (profile)",
                  "remat": "Remat policies (train step)",
                  **attention_report.TITLES}


def render_markdown(report: dict) -> str:
    device = report["device"]
    lines = [f"# stepjax GPU check ({report['plan']})", "",
             f"- device: {device['count']} x {device['kind']} ({device['backend']}); "
             f"bf16 peak {_num(device['peak_bf16_tflops'])} TFLOP/s"
             + (f" ({device['peak_note']})" if device.get("peak_note") else ""),
             *([f"- Mosaic GPU flash attention: {device['mosaic_attention']}"]
               if device.get("mosaic_attention") else []),
             *([f"- Mosaic GPU grouped matmuls: {device['mosaic_grouped_matmuls']}"]
               if device.get("mosaic_grouped_matmuls") else []),
             f"- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
             f"- started {report['started']}, {report['seconds']:.0f} s in all; "
             f"exit status {report['exit_status']}", "", "## Targets", "",
             markdown_table(["target", "value", "goal", "met"],
                            [[t["target"], _num(t["value"]), t["goal"],
                              {True: "yes", False: "NO", None: "-"}[t["met"]]]
                             for t in report["targets"]])]
    renderers = {"checks": lambda s: [_checks_table(s.get("records", []))],
                 "attention": lambda s: [_attention_table(s.get("records", []))],
                 "moe": lambda s: [_moe_table(s.get("records", []))],
                 "train": _train_lines, "legs": moe_legs.markdown,
                 "profile": profiling.markdown, "remat": remat_markdown,
                 **attention_report.RENDERERS}
    for name, section in report["sections"].items():
        lines += ["", f"## {SECTION_TITLES[name]}", "",
                  f"{section['status']} ({section.get('seconds', 0):.0f} s)"
                  + (f": {section['note']}" if section.get("note") else ""), ""]
        if section.get("records") or name == "train" and section["status"] != "skipped":
            lines += renderers[name](section)
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "gpu_report.json", out_dir / "gpu_report.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(render_markdown(report))
    return json_path, md_path
