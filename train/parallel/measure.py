"""`python -m train.plan --measure`: XLA's own per-device memory of the real train step, beside
the estimate.

The step is the one training compiles (train/compiled_step.py: same jitted function, mesh and
shardings), lowered from shapes alone on this host's devices and compiled; nothing is allocated
or trained. `compiled.memory_analysis()` reports per device the bytes of the arguments (the
state and the batch), the outputs (the new state and the metrics), the temporaries (gradients,
activations, the optimizer's intermediates: one buffer XLA packs them into) and the aliased
bytes (outputs written into donated arguments: the state). What one device must hold is

    peak = argument + output - alias + temp

(XLA:CPU's own `peak_memory_in_bytes` leaves the temporaries out). The compile uses the XLA
flags of this process (`XLA_FLAGS`), which are the ones a run started the same way uses; they
are reported with the figures because they move them (docs/parallelism.md, "Measured against
XLA").
"""

from __future__ import annotations

import math
import os
import time

import jax

from model.config.cli import format_table
from model.parallel.rules import use_mesh
from train.compiled_step import lower_train_step, step_layout
from train.config import RunConfig
from train.parallel.memory_plan import PlanError, format_bytes
from train.parallel.sharding import check_batch_fits, make_mesh

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
# XLA:CPU schedules breadth-first for its concurrent runtime unless told to minimise memory
CPU_MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def mesh_devices(sizes: dict[str, int]) -> list:
    """The first prod(sizes) devices of this host, or PlanError naming how to get more."""
    needed = math.prod(sizes.values())
    devices = jax.devices()
    if needed > len(devices):
        hint = (f"; on a CPU machine start with XLA_FLAGS={HOST_DEVICES_FLAG}={needed} "
                "(set before JAX starts)" if devices[0].platform == "cpu" else "")
        raise PlanError(f"--measure: the mesh needs {needed} devices, this host has "
                        f"{len(devices)} {devices[0].platform} device(s){hint}")
    return devices[:needed]


def measure_step(run: RunConfig, sizes: dict[str, int]) -> dict:
    """Compiles the train step of `run` on a mesh of `sizes` -> XLA's per-device bytes
    (`peak_bytes`, `argument_bytes`, `output_bytes`, `temp_bytes`, `alias_bytes`), the
    platform, the XLA flags and the seconds the compile took."""
    devices = mesh_devices(sizes)
    mesh = make_mesh(run.mesh, devices)
    try:
        check_batch_fits(run, mesh)
    except ValueError as err:
        raise PlanError(str(err)) from None
    start = time.perf_counter()
    with use_mesh(mesh):
        compiled = lower_train_step(step_layout(run, mesh), run).compile()
    measured = compiled_memory(compiled)
    if measured is None:
        raise PlanError(f"--measure: XLA gives no memory analysis on {devices[0].platform}")
    return {**measured, "platform": devices[0].platform,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "compile_seconds": round(time.perf_counter() - start, 1)}


def compiled_memory(compiled) -> dict[str, int] | None:
    """XLA's per-device bytes of a compiled program: its arguments, outputs, temporaries, the
    outputs aliased to (donated) arguments, and the peak they add up to, aliased outputs
    counted once; None where the backend gives no analysis."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    measured = {"argument_bytes": int(stats.argument_size_in_bytes),
                "output_bytes": int(stats.output_size_in_bytes),
                "temp_bytes": int(stats.temp_size_in_bytes),
                "alias_bytes": int(stats.alias_size_in_bytes)}
    measured["peak_bytes"] = (measured["argument_bytes"] + measured["output_bytes"]
                              - measured["alias_bytes"] + measured["temp_bytes"])
    return measured


def matched_rows(plan: dict, measured: dict) -> list[tuple[str, int, int]]:
    """(row, estimate, XLA) for the rows both sides have: the step's inputs (state + batch), its
    outputs beyond the donated state (the metrics; the planner counts none), the temporaries
    (compute copy, gradients, activations) and the total against the peak."""
    pd = plan["per_device_bytes"]
    inputs = (pd["params"] + pd["optimizer_state"] + pd["other_state"]
              + plan["activation_parts_bytes"]["batch"])
    return [("state + batch (arguments)", inputs, measured["argument_bytes"]),
            ("outputs not written into the donated state", 0,
             measured["output_bytes"] - measured["alias_bytes"]),
            ("compute copy + gradients + activations (temporaries)", pd["total"] - inputs,
             measured["temp_bytes"]),
            ("total (peak)", pd["total"], measured["peak_bytes"])]


def render_measured(plan: dict, measured: dict) -> str:
    """The estimate beside XLA's figures, row by row, with the flags of the compile."""
    rows = [[name, format_bytes(estimate), format_bytes(real),
             f"{estimate / real:.2f}" if real else "-"]
            for name, estimate, real in matched_rows(plan, measured)]
    table = format_table(["per device", "estimate", "XLA (compiled)", "estimate / XLA"], rows)
    flags = measured["xla_flags"] or "(none)"
    text = (f"measured: the train step compiled on {plan['devices']} {measured['platform']} "
            f"device(s) in {measured['compile_seconds']:.0f} s; XLA_FLAGS {flags}\n{table}\n"
            "(XLA: " + ", ".join(f"{k} {format_bytes(measured[f'{k}_bytes'])}" for k in
                                 ("argument", "output", "alias", "temp"))
            + "; peak = argument + output - alias + temp)")
    if measured["platform"] == "cpu" and CPU_MEMORY_SCHEDULER not in flags:
        text += (f"\nnote: XLA:CPU's default scheduler orders for concurrency, not memory, and "
                 f"can hold several times the peak of GPU/TPU schedules; {CPU_MEMORY_SCHEDULER} "
                 "schedules for memory (docs/parallelism.md)")
    return text
