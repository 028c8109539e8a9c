"""`make gpu-check`: the accelerator check in one command, on whatever JAX sees.

    python -m benchmarks.gpu.suite [--dry-run] [--out DIR] [--sections checks attention ...]
        [--train-config PATH] [--train-override KEY=VALUE ...] [--limit SECTION=SECONDS ...]
        [--budget SECONDS]

Sections, in this order (benchmarks.gpu.plans sizes them; each records its results or
"skipped: reason"):
1. checks: every `attention_impl` and `moe_impl` of the implementation tables against an XLA
   reference, forward and gradients, tiny and medium shapes (benchmarks.gpu.checks); the
   expert-parallel `ragged` collective when several devices are present (benchmarks.gpu.ep_check).
2. legs: the MoE's grouped matmuls per leg (fwd, dx, dw) on each candidate kernel and
   configuration; the fastest correct ones serve the rest of the run (benchmarks.gpu.moe_legs)
   and are written to DIR/grouped_leg_table.json.
3. train: configs/gpu_1b.yaml (~1B, bfloat16) for a few dozen steps: tokens/s, MFU against
   the device's dense bf16 peak (benchmarks.pallas_attention.PEAKS; unknown device: omitted),
   XLA's scratch memory beside train.plan's estimate.
4. moe: the MoE layer per `moe_impl` against a dense FFN of equal active FLOPs.
5. profile: two more train steps under jax.profiler, time per category (benchmarks.gpu.profiling).
6. attention: forward + backward of `xla`, `cudnn`, `pallas` at 4k-32k, SWA and full.
7. remat: the train step with remat_policy=dots_with_kernels against the config's policy.
8. decode: tokens/s at batch 1 and 32, without and with MTP speculation: the trained model and
   the MiMo and DeepSeek-V4 ~1B configs (benchmarks.gpu.decode).
9. attention_sweep: block sizes of the Mosaic GPU flash attention (sm90), writes the chosen
   table DIR/flash_attention_blocks.json (benchmarks.gpu.attention_sweep).
10. v4_layers: DeepSeek-V4's CSA, HCA and sliding-window layers against a dense full-attention
   layer, 8k-64k (benchmarks.gpu.v4_layers).
Writes DIR/gpu_report.json and DIR/gpu_report.md (default benchmarks/results/;
docs/kernels.md, "make gpu-check", says how to read them). Exit status 1 if a correctness check
failed or raised or a whole section failed (a timing case that fails, e.g. out of memory, is
recorded and does not count), 2 for bad arguments.

Without an accelerator (CPU) it runs the dry run (`--dry-run` anywhere): tiny shapes and a
couple of steps, in seconds. Installs nothing and needs no network.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import platform
import sys
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import jax

from benchmarks.gpu import moe_probe
from benchmarks.common import RESULTS
from benchmarks.gpu.attention_sweep import run_attention_sweep as attention_sweep
from benchmarks.gpu.checks import TOLERANCE, check_attention, check_moe, first_line
from benchmarks.gpu.decode import decode_section
from benchmarks.gpu.ep_check import check_ragged_collective
from benchmarks.gpu.moe_legs import run_legs
from benchmarks.gpu.mosaic_probe import probe_mosaic
from benchmarks.gpu.plans import ACCELERATOR, DRY_RUN, SECTIONS, Plan, attention_shapes
from benchmarks.gpu.profiling import run_profile
from benchmarks.gpu.report import targets, write_report
from benchmarks.gpu.timings import time_attention, time_moe
from benchmarks.gpu.training import run_remat, train_section
from benchmarks.gpu.v4_layers import run_v4_layers as v4_layers
from benchmarks.pallas_attention import peak_for
from model.config import ModelConfig
from pallas_kernels.attention import UNAVAILABLE
from pallas_kernels.gpu_arch import compute_capability, is_hopper
from train.config import load_run_config

PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "libtpu", "flax",
            "optax", "orbax-checkpoint")


def cudnn_version() -> str | None:
    """The cuDNN that JAX's CUDA plugin loaded (e.g. "9.14.0"), None without one."""
    try:
        from jax._src.lib import cuda_versions
        number = cuda_versions.cudnn_get_version()
    except Exception:  # no CUDA plugin, or cuDNN not found
        return None
    return f"{number // 10000}.{number // 100 % 100}.{number % 100}"


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    if jax.default_backend() == "gpu" and (cudnn := cudnn_version()):
        found["cudnn"] = cudnn
    return found


def device_info() -> dict:
    device = jax.devices()[0]
    peak = peak_for(device.device_kind, None, None)[0]
    info = {"kind": device.device_kind, "backend": jax.default_backend(),
            "count": jax.device_count(), "platform_version": getattr(
                getattr(device, "client", None), "platform_version", None),
            "peak_bf16_tflops": peak}
    if peak is None:
        info["peak_note"] = (f"no dense bf16 peak known for {device.device_kind!r}: MFU and "
                             "% of peak omitted")
    return info


class Context(NamedTuple):
    """What every section runner sees."""

    plan: Plan
    model: ModelConfig  # of the train config: the timed attention and MoE shapes
    backend: str
    peak_tflops: float | None
    shared: dict  # results later sections use ("trained", "train_record")


def run_checks(ctx: Context, deadline: float) -> dict:
    records = []
    for table, cases, check in (("attention", ctx.plan.attention_checks, check_attention),
                                ("moe", ctx.plan.moe_checks, check_moe)):
        for case in cases:
            if time.monotonic() > deadline:
                records.append({"table": table, "impl": "*", "case": case.label,
                                "dtype": case.dtype, "tolerance": TOLERANCE[case.dtype],
                                "status": "skipped", "note": "section time limit reached"})
                continue
            records += check(case, ctx.backend)
    records += check_ragged_collective(ctx.backend)
    failed = [r for r in records if r["status"] in ("fail", "error")]
    return {"status": "failed" if failed else "done", "records": records,
            "note": f"{len(failed)} of {len(records)} checks failed" if failed else ""}


def run_attention(ctx: Context, deadline: float) -> dict:
    plan = ctx.plan
    return {"status": "done", "dtype": plan.timing_dtype, "records": time_attention(
        attention_shapes(ctx.model), list(plan.attention_lengths), list(plan.attention_impls),
        batch=plan.attention_batch, dtype=plan.timing_dtype, repeats=plan.attention_repeats,
        backend=ctx.backend, peak_tflops=ctx.peak_tflops, deadline=deadline)}


def run_moe(ctx: Context, deadline: float) -> dict:
    plan, moe = ctx.plan, ctx.model.moe
    return {"status": "done", "dtype": plan.timing_dtype, "tokens": plan.moe_tokens,
            "records": time_moe(tokens=plan.moe_tokens, d_model=ctx.model.d_model,
                                experts=moe.num_experts, top_k=moe.top_k,
                                expert_hidden=moe.expert_hidden, block_size=moe.block_size,
                                impls=list(plan.moe_impls), dtype=plan.timing_dtype,
                                rounds=plan.moe_rounds, backend=ctx.backend)}


def run_train(ctx: Context, deadline: float) -> dict:
    plan = ctx.plan
    section, ctx.shared["trained"] = train_section(
        plan.train_config, list(plan.train_overrides), warmup=plan.train_warmup,
        steps=plan.train_steps, peak_tflops=ctx.peak_tflops)
    ctx.shared["train_record"] = section
    return section


def run_decode(ctx: Context, deadline: float) -> dict:
    plan = ctx.plan
    return decode_section(ctx.shared.get("trained"), plan.decode_others,
                          prompt_len=plan.decode_prompt, new_tokens=plan.decode_new_tokens,
                          batches=plan.decode_batches, deadline=deadline)


def run_attention_sweep(ctx: Context, deadline: float) -> dict:
    return attention_sweep(attention_shapes(ctx.model), backend=ctx.backend,
                           capability=compute_capability(), device=jax.devices()[0].device_kind,
                           out_dir=ctx.shared["out_dir"], deadline=deadline)


def run_v4_layers(ctx: Context, deadline: float) -> dict:
    return v4_layers(list(ctx.plan.v4_cases), dry_run=ctx.plan.v4_dry_run,
                     repeats=ctx.plan.attention_repeats, deadline=deadline)


# section -> runner(context, deadline); moe, train, profile, remat and decode are one case
# each, which a deadline cannot stop midway.
RUNNERS = {"checks": run_checks, "legs": run_legs, "train": run_train, "moe": run_moe,
           "profile": run_profile, "attention": run_attention, "remat": run_remat,
           "decode": run_decode, "attention_sweep": run_attention_sweep,
           "v4_layers": run_v4_layers}


def run_sections(ctx: Context, selected: list[str]) -> dict:
    """{section: record with `status` and `seconds`} for the selected sections, in order."""
    started = time.monotonic()
    sections = {}
    for name in (name for name in SECTIONS if name in selected):
        clock = time.monotonic()
        print(f"[gpu-check] {name} ...", flush=True)
        if clock - started > ctx.plan.budget_s:
            section = {"status": "skipped",
                       "note": f"the overall budget of {ctx.plan.budget_s:.0f} s was spent"}
        else:
            try:
                section = RUNNERS[name](ctx, clock + ctx.plan.limits[name])
            except Exception as err:  # one broken section must not cost the others' results
                section = {"status": "error", "note": first_line(err)}
        section["seconds"] = time.monotonic() - clock
        print(f"[gpu-check] {name}: {section['status']} ({section['seconds']:.0f} s)",
              flush=True)
        sections[name] = section
    return sections


def parse_pairs(parser: argparse.ArgumentParser, items: list[str], flag: str) -> dict:
    pairs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in SECTIONS:
            parser.error(f"{flag}: expected SECTION=SECONDS with SECTION one of "
                         f"{', '.join(SECTIONS)}; got {item!r}")
        try:
            pairs[name] = float(value)
        except ValueError:
            parser.error(f"{flag}: {value!r} is not a number of seconds")
    return pairs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.suite", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes, a couple of steps (the default without an accelerator)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of the report files")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--train-config", help="run config of the train and decode sections")
    parser.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE",
                        help="override of the train config (repeatable), e.g. "
                             "model.remat_policy=none")
    parser.add_argument("--limit", action="append", default=[], metavar="SECTION=SECONDS",
                        help="a section's time limit (repeatable)")
    parser.add_argument("--budget", type=float, help="seconds after which no section starts")
    args = parser.parse_args(argv)

    device = device_info()
    dry_run = args.dry_run or device["backend"] == "cpu"
    plan = DRY_RUN if dry_run else ACCELERATOR
    plan = plan.with_changes(
        train_config=args.train_config or plan.train_config,
        train_overrides=plan.train_overrides + tuple(args.train_override),
        limits={**plan.limits, **parse_pairs(parser, args.limit, "--limit")},
        budget_s=plan.budget_s if args.budget is None else args.budget)
    try:
        model = load_run_config(plan.train_config, list(plan.train_overrides)).model
    except (ValueError, OSError) as err:  # ConfigError is a ValueError
        parser.error(f"train config: {' '.join(str(err).split())}")
    if dry_run and not args.dry_run:
        print(f"[gpu-check] no accelerator ({device['backend']}): running the dry run")

    started = time.monotonic()
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if not dry_run and is_hopper(compute_capability()):
        grouped_probe = moe_probe.start()  # runs alongside the attention probe
        usable, device["mosaic_attention"] = probe_mosaic()
        if not usable:
            UNAVAILABLE["mosaic"] = device["mosaic_attention"]
        print(f"[gpu-check] Mosaic GPU flash attention: {device['mosaic_attention']}", flush=True)
        device["mosaic_grouped_matmuls"] = moe_probe.finish(grouped_probe)
        print(f"[gpu-check] Mosaic GPU grouped matmuls: {device['mosaic_grouped_matmuls']}",
              flush=True)
    ctx = Context(plan, model, device["backend"], device["peak_bf16_tflops"],
                  shared={"out_dir": args.out})
    sections = run_sections(ctx, args.sections)
    exit_status = int(any(s["status"] in ("failed", "error") for s in sections.values()))
    report = {"plan": plan.name, "device": device, "versions": versions(), "started": stamp,
              "seconds": time.monotonic() - started, "exit_status": exit_status,
              "targets": targets(sections, device_run=not dry_run), "sections": sections}
    json_path, md_path = write_report(report, args.out)
    print(md_path.read_text())
    print(f"[gpu-check] report: {json_path} and {md_path}")
    return exit_status


if __name__ == "__main__":
    sys.exit(main())
