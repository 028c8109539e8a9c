"""The profile section of `make gpu-check` (benchmarks.gpu.suite): where a train step's time goes.

Two steps of the train section's compiled step run under `jax.profiler.trace`; the trace's XLA
op events (device planes' "XLA Ops" lines on GPU/TPU; on CPU the host threads' thunk events)
carry the HLO instruction they ran (`hlo_op`, or the event's name on "XLA Ops" lines). The
compiled module's text maps each instruction to its JAX source path (`metadata={op_name=...}`:
the jit, the transforms, the Flax module path and the named scopes; where the module text has
none, the path a device trace attaches as `tf_op`), which decides the category:

    optimizer              under the `optimizer` scope (train/state.py; Muon's float16 Polar
                           Express on GPU, AdamW, the gradient norm)
    router                 under `router` (model/layers/moe.py, router.py, hash_routing.py)
    dispatch               under `dispatch`: the sort, row gathers and the combine
                           (model/ops/moe_dispatch.py, permute.py)
    expert matmuls         under `experts` (the routed experts' `moe_impl`), except elementwise
                           ops and the `monitors` statistics
    attention              under a `self_attn` module, except its projections and norms
    dense matmuls          every other dot: projections, shared expert, dense FFN, output head
    norms and elementwise  norms and elementwise / reduction ops elsewhere
    other                  the rest: loss bookkeeping, monitors, copies, loops, ...

Each event counts its self time (nested events on the same line are subtracted), so a loop's
event does not count its body twice. On GPU the ops of one stream run one after another: the
categories add up to the device's busy time, and "idle" is the profiled wall time the device
spent waiting. On CPU, thunks run on several threads at once, so only the shares mean anything.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.common import markdown_table

CATEGORIES = ("attention", "expert matmuls", "dispatch", "router", "dense matmuls",
              "norms and elementwise", "optimizer", "other")

# JAX primitives that are memory-bound elementwise / reduction work wherever they sit.
ELEMENTWISE = frozenset((
    "abs add and broadcast_in_dim clamp convert_element_type cos div eq erf exp exp2 expm1 ge "
    "gt integer_pow is_finite le log log1p logistic lt max min mul ne neg not or pow "
    "reduce_max reduce_min reduce_sum rem rsqrt select_n sign sin sqrt square sub tanh "
    "xor").split())
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "q_norm", "k_norm")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name=\"([^\"]*)\"")


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the JAX op_name path of its metadata."""
    names = {}
    for line in hlo_text.splitlines():
        found = _INSTRUCTION.match(line)
        if found:
            names[found.group(1)] = found.group(2)
    return names


def category(op_name: str) -> str:
    """The category (module docstring) of one op from its JAX path."""
    parts = op_name.split("/")
    primitive = re.sub(r"\[.*", "", parts[-1])
    scopes = set(parts[:-1])
    elementwise = primitive in ELEMENTWISE
    if "optimizer" in scopes:
        return "optimizer"
    if "router" in scopes:
        return "router"
    if "dispatch" in scopes:
        return "dispatch"
    if "experts" in scopes and "monitors" not in scopes:
        return "norms and elementwise" if elementwise else "expert matmuls"
    if "self_attn" in scopes and not scopes.intersection(ATTENTION_PARTS):
        return "attention"
    if primitive == "dot_general":
        return "dense matmuls"
    if elementwise or any("norm" in scope for scope in scopes):
        return "norms and elementwise"
    return "other"


def _stats(event) -> dict:
    return dict(event.stats)


def _self_times(events: list[tuple[int, int, str]]) -> list[tuple[str, int]]:
    """(start_ns, duration_ns, op) of one line -> (op, self ns): nested events subtracted."""
    result, stack = [], []  # stack of [end, index into result]
    for start, duration, op in sorted(events, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][0] <= start:
            stack.pop()
        if stack:
            result[stack[-1][1]][1] -= duration
        result.append([op, duration])
        stack.append([start + duration, len(result) - 1])
    return [(op, max(ns, 0)) for op, ns in result]


def _line_events(line, module: str | None, named_by_event: bool,
                 paths: dict[str, str]) -> list[tuple[str, int]]:
    """(HLO instruction, self ns) of one trace line's op events; the JAX paths that device
    traces attach to their events (`tf_op`) go into `paths`."""
    events = []
    for event in line.events:
        stats = _stats(event)
        op = stats.get("hlo_op") or (event.name if named_by_event else None)
        if op is None or (module and stats.get("hlo_module", module) != module):
            continue
        if stats.get("tf_op"):
            paths[str(op)] = str(stats["tf_op"])
        events.append((int(event.start_ns), int(event.duration_ns), str(op)))
    return _self_times(events)


def op_events(xplane_path: Path, module: str | None) -> tuple[list[tuple[str, int]], dict]:
    """((HLO instruction, self ns) of every XLA op event of the trace (of `module` where the
    events say their module): a device's "XLA Ops" lines (any of its lines with `hlo_op`
    events if it has none), else the host threads' events with `hlo_op` (CPU); the JAX paths
    the trace itself gives per instruction)."""
    from jax.profiler import ProfileData

    planes = list(ProfileData.from_file(str(xplane_path)).planes)
    found, paths = [], {}
    for plane in (p for p in planes if p.name.startswith("/device:")):
        lines = list(plane.lines)
        ops_lines = [line for line in lines if line.name == "XLA Ops"]
        for line in ops_lines or lines:
            found += _line_events(line, module, bool(ops_lines), paths)
    if not found:
        for plane in (p for p in planes if p.name.startswith("/host:")):
            for line in plane.lines:
                found += _line_events(line, module, False, paths)
    return found, paths


def attribute(events: list[tuple[str, int]], names: dict[str, str]) -> tuple[dict, float]:
    """(seconds per category, every category present; seconds of events whose instruction
    has no JAX path in the module text (XLA's own copies and loop control, or another
    module's ops), counted as "other")."""
    seconds, unnamed = dict.fromkeys(CATEGORIES, 0.0), 0.0
    for op, ns in events:
        if op in names:
            seconds[category(names[op])] += ns * 1e-9
        else:
            seconds["other"] += ns * 1e-9
            unnamed += ns * 1e-9
    return seconds, unnamed


def module_name(hlo_text: str) -> str | None:
    found = re.match(r"HloModule\s+([\w.\-]+)", hlo_text)
    return found.group(1) if found else None


def profile_steps(compiled, state, batches: list, mask_meta) -> tuple[dict, object]:
    """Runs `compiled(state, batch, mask_meta)` once per batch under the profiler -> (the
    section record with the category table, the state after the steps: the step donates
    its input state)."""
    hlo = compiled.as_text()
    with tempfile.TemporaryDirectory() as trace_dir:
        start = time.perf_counter()
        with jax.profiler.trace(trace_dir):
            for batch in batches:
                state, metrics = compiled(state, batch, mask_meta)
                jax.block_until_ready(metrics)
        wall = time.perf_counter() - start
        paths = sorted(Path(trace_dir).rglob("*.xplane.pb"))
        if not paths:
            return {"status": "error", "note": "the profiler wrote no trace"}, state
        events, trace_paths = op_events(paths[-1], module_name(hlo))
    seconds, unnamed = attribute(events, {**trace_paths, **op_names(hlo)})
    busy = sum(seconds.values())
    steps = len(batches)
    records = [{"category": name, "ms_per_step": 1e3 * s / steps,
                "share": s / busy if busy else None} for name, s in seconds.items()]
    record = {"status": "done", "steps": steps, "wall_ms_per_step": 1e3 * wall / steps,
              "op_ms_per_step": 1e3 * busy / steps, "unnamed_ms_per_step": 1e3 * unnamed / steps,
              "events": len(events), "records": records}
    if "/optimizer/" not in hlo:
        # JAX's persistent compilation cache keys programs without their metadata, so an
        # executable compiled from older code can carry op paths without the named scopes.
        record["note"] = ("the step's op metadata lacks the named scopes (an executable from a "
                          "persistent compilation cache compiled from other code?): optimizer, "
                          "router, dispatch and expert time fall into the other categories")
    return record, state


def run_profile(ctx, deadline: float) -> dict:
    """The section runner (benchmarks.gpu.suite): the train section's step and state."""
    trained = ctx.shared.get("trained")
    if trained is None:
        return {"status": "skipped", "note": "no trained model (train section not run or failed)"}
    batches = [trained.data.batch() for _ in range(ctx.plan.profile_steps)]
    record, state = profile_steps(trained.step, trained.state, batches, np.bool_(False))
    ctx.shared["trained"] = trained._replace(state=state)
    return record


def markdown(section: dict) -> list[str]:
    rows = [[r["category"], f"{r['ms_per_step']:.1f}",
             "-" if r["share"] is None else f"{100 * r['share']:.1f}%"]
            for r in section.get("records", [])]
    idle = section.get("wall_ms_per_step", 0) - section.get("op_ms_per_step", 0)
    return [f"{section.get('steps')} steps; per step: {section.get('wall_ms_per_step', 0):.1f} ms "
            f"wall, {section.get('op_ms_per_step', 0):.1f} ms in XLA ops (device idle or host "
            f"{idle:.1f} ms on a GPU; CPU threads overlap), of which "
            f"{section.get('unnamed_ms_per_step', 0):.1f} ms in ops without a JAX path (XLA's "
            "copies, loop control)", "",
            markdown_table(["category", "ms per step", "share of op time"], rows)]
