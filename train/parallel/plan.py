"""Per-device memory plan of a run on a device mesh, from abstract shapes only.

    python -m train.plan --config configs/step35_flash.yaml \\
        --mesh pipeline=2,expert=8,data=256 --batch-size 8192 --seq-len 4096 [--json]

Nothing is allocated and no device is needed, so a 4096-device mesh is planned on a laptop in
seconds. How each row is counted follows (train/parallel/memory_plan.py). `--measure` also
compiles the real train step on this host's devices and shows XLA's per-device bytes beside
the estimate (train/parallel/measure.py).

Exit codes: 0 (a plan was printed; over budget is a WARNING on stderr unless --strict, then 1),
2 (bad flags, config, mesh or a mesh that does not fit the devices or the layer plan).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from typing import Sequence

from model.config.cli import ArgumentParser, format_table
from model.parallel.rules import MESH_AXES
from train.config import RunConfig, load_run_config
from train.parallel import memory_plan
from train.parallel.measure import measure_step, mesh_devices, render_measured
from train.parallel.memory_plan import PlanError, format_bytes, plan_memory

# ---- mesh ------------------------------------------------------------------------------------


def parse_mesh(text: str) -> dict[str, int]:
    """'data=8,expert=8,pipeline=8' -> {'data': 8, 'expert': 8, 'pipeline': 8}."""
    sizes: dict[str, int] = {}
    for item in text.split(","):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not name:
            raise PlanError(f"--mesh: expected comma-separated axis=size, e.g. "
                            f"data=8,expert=8,pipeline=8; got {text!r}")
        if name not in MESH_AXES:
            raise PlanError(f"--mesh: unknown axis {name!r}; axes are {', '.join(MESH_AXES)}")
        if name in sizes:
            raise PlanError(f"--mesh: axis {name!r} given twice")
        try:
            size = int(value)
        except ValueError:
            raise PlanError(f"--mesh: {name}={value!r} is not an integer") from None
        if size < 1 and size != -1:
            raise PlanError(f"--mesh: {name}={size} must be a positive integer or -1")
        sizes[name] = size
    return sizes


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
        "see train/parallel/memory_plan.py)",
        f"mesh:      {mesh} -> {plan['devices']} devices, "
        f"ZeRO-1 {'on' if plan['zero1'] else 'off'}",
        f"model:     {plan['num_params']:,} params ({plan['param_dtype']}), compute "
        f"{plan['compute_dtype']}, remat {plan['remat_policy']!r}, attention "
        f"{plan['attention_impl']!r}",
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
    grads = "gradients" + (" (sum + micro-batch)" if plan["gradient_copies"] > 1 else "")
    rows = [["params", format_bytes(pd["params"])],
            ["optimizer state", format_bytes(pd["optimizer_state"])],
            [grads, format_bytes(pd["gradients"])],
            ["other state", format_bytes(pd["other_state"])],
            ["activations (estimate)", format_bytes(pd["activations"])]]
    rows += [[f"  {k.replace('_', ' ')}", format_bytes(v)]
             for k, v in plan["activation_parts_bytes"].items()]
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
            "model.pipeline_virtual_stages=V picks V)")


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
    parser.add_argument("--device-memory", type=float, default=80.0, metavar="GiB",
                        help="memory budget per device (default: 80)")
    parser.add_argument("--strict", action="store_true",
                        help="exit with code 1 when over budget")
    parser.add_argument("--measure", action="store_true",
                        help="also compile the real train step on this host's devices (no "
                             "data, nothing trained) and show XLA's per-device memory beside "
                             "the estimate; on a CPU machine start with XLA_FLAGS="
                             "--xla_force_host_platform_device_count=N for an N-device mesh")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. model.remat_policy=full train.seq_len=4096")
    return parser


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
    overrides = list(args.overrides)
    for flag, key in (("batch_size", "train.batch_size"), ("micro_batch_size",
                      "train.micro_batch_size"), ("seq_len", "train.seq_len")):
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
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


if __name__ == "__main__":
    sys.exit(main())
