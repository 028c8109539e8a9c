"""Per-device memory plan of a run on a device mesh, from abstract shapes only.

    python -m train.plan --config configs/step35_flash.yaml \\
        --mesh pipeline=2,expert=8,data=256 --batch-size 8192 --seq-len 4096 [--json]

Nothing is allocated and no device is needed, so a 4096-device mesh is planned on a laptop in
seconds. How each row is counted follows (train/parallel/memory_plan.py). `--measure` also
compiles the real train step on this host's devices and shows XLA's per-device bytes beside
the estimate (train/parallel/measure.py). `--fit --devices N` searches the layouts that fit N
devices, fastest first (train/parallel/fit.py):

    python -m train.plan --config configs/step35_flash.yaml --fit --devices 4096 \
        --batch-size 4096 --seq-len 4096 [--device-memory 80] [--mfu 0.4] [--json]

Exit codes: 0 (a plan was printed; over budget is a WARNING on stderr unless --strict, then 1;
--fit: 1 when no layout fits), 2 (bad flags, config, mesh or a mesh that does not fit the
devices or the layer plan).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from typing import Sequence

from model.config.cli import ArgumentParser, finite_float, format_table
from model.parallel.device_mesh import parse_mesh as parse_axis_sizes
from model.parallel.rules import MESH_AXES
from train.config import RunConfig, load_run_config
from train.parallel import memory_plan
from train.parallel.fit import fit, no_fit_reason, render_fit
from train.parallel.measure import measure_step, mesh_devices, render_measured
from train.parallel.memory_plan import PlanError, format_bytes, plan_memory
from train.parallel.step_time import Hardware

# ---- mesh ------------------------------------------------------------------------------------


def parse_mesh(text: str) -> dict[str, int]:
    """'data=8,expert=8,pipeline=8' -> {'data': 8, 'expert': 8, 'pipeline': 8}."""
    try:
        return parse_axis_sizes(text)
    except ValueError as err:
        raise PlanError(str(err)) from None


def resolve_mesh(run: RunConfig, devices: int | None) -> dict[str, int]:
    """{axis: size} of run.mesh on `devices` devices (default: the product of fixed sizes)."""
    sizes = {a: getattr(run.mesh, a) for a in MESH_AXES}
    if devices is None:
        free = [a for a, s in sizes.items() if s == -1]
        if free:
            raise PlanError(f"mesh.{free[0]}=-1 takes the remaining devices: pass --devices N "
                            f"or give every axis a size in --mesh")
        devices = math.prod(sizes.values())
    if devices < 1:
        raise PlanError(f"--devices: must be >= 1, got {devices}")
    return run.mesh.axis_sizes(devices)


# ---- the table ------------------------------------------------------------------------------


def render(plan: dict, config: str) -> str:
    sizes = plan["mesh"]
    mesh = " ".join(f"{a}={sizes[a]}" for a in MESH_AXES)
    lines = [
        f"memory plan for {config} (activations are an estimate; "
        "see train/parallel/activation_plan.py)",
        f"mesh:      {mesh} -> {plan['devices']} devices, "
        f"ZeRO-1 {'on' if plan['zero1'] else 'off'}",
        f"model:     {plan['num_params']:,} params ({plan['param_dtype']}"
        f"{', master weights sharded over data' if plan['sharded_master'] else ''}), compute "
        f"{plan['compute_dtype']}, remat {plan['remat_policy']!r}, attention "
        f"{plan['attention_impl']!r}"
        + (f", expert exchange {plan['ep_collective']!r}" if sizes["expert"] > 1 else ""),
        f"batch:     {plan['batch_size']} x {plan['seq_len']} tokens, micro-batch "
        f"{plan['micro_batch_size']} ({plan['accumulation_steps']} accumulation step"
        f"{'s' * (plan['accumulation_steps'] != 1)}), {plan['rows_per_device']} row(s) = "
        f"{plan['tokens_per_device']:,} tokens per device "
        f"(data parallel {plan['data_parallel_size']})",
    ]
    pipe = plan["pipeline"]
    if pipe:
        lines.append(render_pipeline(pipe))
    pd = plan["per_device_bytes"]
    rows = [["params", format_bytes(pd["params"])],
            ["optimizer state", format_bytes(pd["optimizer_state"])],
            ["compute copy of params", format_bytes(pd["compute_params"])],
            [f"gradients ({plan['gradients_counted']})", format_bytes(pd["gradients"])],
            ["other state", format_bytes(pd["other_state"])],
            ["activations (estimate)", format_bytes(pd["activations"])]]
    rows += [[f"  {k.replace('_', ' ')}", format_bytes(v)]
             for k, v in plan["activation_parts_bytes"].items()]
    sets = plan["working_sets_bytes"]  # the larger one is the working set row
    rows += [["    (layer, logits chunk)",
              f"{format_bytes(sets['layer'])}, {format_bytes(sets['logits_chunk'])}"]]
    rows += [["total", format_bytes(pd["total"])],
             ["budget (--device-memory)", format_bytes(plan["budget_bytes"])]]
    lines += ["", format_table(["per device", "bytes"], rows), ""]
    verdict = "within budget" if plan["within_budget"] else "OVER BUDGET"
    lines.append(f"{verdict}: {100 * plan['utilisation']:.1f}% of the device budget")
    return "\n".join(lines)


def render_pipeline(pipe: dict) -> str:
    chunks = pipe["chunk_repeats"]
    sizes = ", ".join(f"{count} of {size}" for size, count in
                      sorted(collections.Counter(chunks).items(), reverse=True))
    split = (f"{len(chunks)} chunks of {chunks[0]} repeat{'s' * (chunks[0] > 1)}"
             if len(set(chunks)) == 1 else
             f"uneven: {len(chunks)} chunks, {sizes} repeats; {pipe['idle_slots']} of "
             f"{len(chunks) * pipe['slots_per_chunk']} slots idle")
    head = (f"pipeline:  {pipe['stages']} stages x {pipe['virtual_stages']} virtual over segment "
            f"{pipe['segment']} ({pipe['segment_period']} layers x {pipe['segment_repeats']}; "
            f"{split}), {pipe['microbatches']} micro-batches, {pipe['schedule']}, "
            f"bubble {100 * pipe['bubble_fraction']:.1f}%")
    rows = [[f"{row['schedule']}{' *' if row['configured'] else ''}",
             str(row["virtual_stages"]), str(row["slots_per_device"]),
             f"{100 * row['bubble_fraction']:.1f}%", format_bytes(row["activations"]),
             format_bytes(row["total"])] for row in pipe["schedules"]]
    table = format_table(["schedule (* configured)", "virtual", "repeat slots/device",
                          "bubble", "activations", "total/device"], rows)
    return (f"{head}\n{table}\n(interleaved bubble = interleaved 1F1B's; both run as JAX's "
            "autodiff of the forward ticks, with GPipe-like activations; "
            "model.pipeline_virtual_stages=V picks V; totals include the compute copy)")


# ---- command line ----------------------------------------------------------------------------


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m train.plan",
                            description=f"{__doc__}\n{memory_plan.__doc__}",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, metavar="PATH", help="run YAML or model preset")
    parser.add_argument("--mesh", metavar="AXIS=N,...",
                        help="mesh sizes, e.g. data=8,expert=8,pipeline=2 (axes: "
                             f"{', '.join(MESH_AXES)}; -1 takes the rest); default: the "
                             "config's mesh section")
    parser.add_argument("--devices", type=int, metavar="N",
                        help="number of devices (default: the product of the mesh sizes)")
    parser.add_argument("--batch-size", type=int, metavar="N", help="train.batch_size")
    parser.add_argument("--micro-batch-size", type=int, metavar="N",
                        help="train.micro_batch_size")
    parser.add_argument("--seq-len", type=int, metavar="N", help="train.seq_len")
    parser.add_argument("--device-memory", type=finite_float, default=80.0, metavar="GiB",
                        help="memory budget per device (default: 80)")
    parser.add_argument("--strict", action="store_true",
                        help="exit with code 1 when over budget")
    parser.add_argument("--measure", action="store_true",
                        help="also compile the real train step on this host's devices (no "
                             "data, nothing trained) and show XLA's per-device memory beside "
                             "the estimate; on a CPU machine start with XLA_FLAGS="
                             "--xla_force_host_platform_device_count=N for an N-device mesh")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    fit = parser.add_argument_group(
        "--fit: search the layouts of --devices N devices (train/parallel/fit.py), ranked by "
        "an estimated step time (train/parallel/step_time.py)")
    fit.add_argument("--fit", action="store_true",
                     help="print the fastest layouts (mesh, remat policy, pipeline micro-batches "
                          "and virtual stages, gradient accumulation) whose plan fits "
                          "--device-memory, for the global --batch-size; exit 1 if none does")
    fit.add_argument("--top", type=int, default=5, metavar="K", help="layouts shown (default 5)")
    for flag, default, what in (
            ("--peak-tflops", Hardware.peak_tflops, "dense peak TFLOP/s of a device in the "
             "compute dtype"),
            ("--mfu", Hardware.mfu, "share of the peak the model's kernels reach"),
            ("--intra-node-gbps", Hardware.intra_node_gbps, "GB/s a device sends within a node"),
            ("--inter-node-gbps", Hardware.inter_node_gbps, "GB/s a device sends to other nodes"),
            ("--node-size", Hardware.node_size, "devices per node")):
        fit.add_argument(flag, type=type(default), default=default, metavar="X",
                         help=f"{what} (default {default:g})")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. model.remat_policy=full train.seq_len=4096")
    return parser


def _overrides(args: argparse.Namespace) -> list[str]:
    """The dotted overrides and those of --batch-size, --micro-batch-size and --seq-len."""
    flags = {"batch_size": "train.batch_size", "micro_batch_size": "train.micro_batch_size",
             "seq_len": "train.seq_len"}
    return [*args.overrides, *(f"{key}={getattr(args, flag)}" for flag, key in flags.items()
                               if getattr(args, flag) is not None)]


def _error(message: str) -> int:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_intermixed_args(argv)
    except SystemExit as exit_:  # argparse errors (one line, code 2) and --help (0)
        return int(exit_.code or 0)
    if args.device_memory <= 0:
        return _error(f"--device-memory: must be > 0 GiB, got {args.device_memory:g}")
    if args.fit:
        return _fit(args)
    overrides = _overrides(args)
    try:
        if args.mesh is not None:
            overrides += [f"mesh.{a}={s}" for a, s in parse_mesh(args.mesh).items()]
        run = load_run_config(args.config, overrides)
        sizes = resolve_mesh(run, args.devices)
        if args.measure:
            mesh_devices(sizes)  # refused before anything is traced
        plan = plan_memory(run, sizes, args.device_memory)
        if args.measure:
            plan["measured"] = measure_step(run, sizes)
    except ValueError as err:
        return _error(str(err))
    text = render(plan, args.config)
    if args.measure:
        text += "\n\n" + render_measured(plan, plan["measured"])
    print(json.dumps(plan, indent=2) if args.json else text)
    for warning in plan["warnings"]:
        print(f"WARNING: {warning}", file=sys.stderr)
    return 1 if args.strict and not plan["within_budget"] else 0


def _fit(args: argparse.Namespace) -> int:
    for flag in ("mesh", "micro_batch_size", "measure", "strict"):
        if getattr(args, flag) not in (None, False):
            name = "--" + flag.replace("_", "-")
            return _error(f"{name}: --fit chooses the layout; leave {name} out")
    if args.devices is None or args.devices < 1:
        return _error("--devices: --fit needs the number of devices, e.g. --devices 4096")
    for flag in ("top", "peak_tflops", "intra_node_gbps", "inter_node_gbps", "node_size"):
        if getattr(args, flag) <= 0:
            return _error(f"--{flag.replace('_', '-')}: must be > 0, got {getattr(args, flag)}")
    if not 0 < args.mfu <= 1:
        return _error(f"--mfu: must be in (0, 1], got {args.mfu:g}")
    overrides = _overrides(args)
    hardware = Hardware(args.peak_tflops, args.mfu, args.intra_node_gbps, args.inter_node_gbps,
                        args.node_size)
    try:
        result = fit(load_run_config(args.config, overrides), args.devices, args.device_memory,
                     hardware, args.top)
    except ValueError as err:
        return _error(str(err))
    print(json.dumps(result, indent=2) if args.json else render_fit(result, args.config))
    if not result["layouts"]:
        print(f"WARNING: {args.config} on {args.devices} devices: {no_fit_reason(result)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
