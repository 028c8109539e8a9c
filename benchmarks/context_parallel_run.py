"""The measurements of benchmarks.context_parallel (imported once XLA_FLAGS is set)."""

from __future__ import annotations

import gzip
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.common import markdown_table, save
from model.parallel.rules import use_mesh
from train.compiled_step import lower_train_step, step_layout
from train.config import load_run_config
from train.parallel.context_plan import context_layer_bytes
from train.parallel.measure import compiled_memory
from train.parallel.sharding import check_batch_fits, make_mesh
from train.state import create_state

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FAMILIES = {"step35": "tiny.yaml", "deepseek_v4": "tiny_deepseek_v4.yaml",
            "mimo": "tiny_mimo.yaml"}
COLLECTIVES = ("all-gather", "collective-permute", "all-reduce", "all-to-all", "reduce-scatter")
DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1}
GIB = 2 ** 30


def packed_row(length: int, vocab: int, seed: int = 0) -> dict:
    """[1, 1, T] of every feature the data pipeline yields (train.data.packing.FEATURES):
    three documents cut at random places, every token a target."""
    rng = np.random.default_rng(seed)
    cuts = sorted(rng.choice(np.arange(1, length), 2, replace=False))
    segments = np.searchsorted(cuts, np.arange(length), side="right").astype(np.int32) + 1
    starts = np.asarray([0, *cuts])[segments - 1]
    positions = (np.arange(length) - starts).astype(np.int32)
    shape = (1, 1, length)
    return {"tokens": rng.integers(0, vocab, shape).astype(np.int32),
            "segment_ids": segments.reshape(shape), "positions": positions.reshape(shape),
            "meta_mask": np.zeros(shape, bool), "loss_mask": np.ones(shape, bool)}


class Step:
    """The train step of `family` at `length` on `context` devices, compiled as training
    compiles it (train/compiled_step.py)."""

    def __init__(self, family: str, length: int, context: int):
        overrides = ["train.batch_size=1", f"train.seq_len={length}", "mesh.data=1",
                     f"mesh.context={context}", "train.progress=false"]
        self.run = load_run_config(CONFIGS / FAMILIES[family], overrides)
        self.mesh = make_mesh(self.run.mesh, jax.devices()[:context])
        check_batch_fits(self.run, self.mesh)
        self.layout = step_layout(self.run, self.mesh)
        self.data = packed_row(length, self.run.model.vocab_size)
        with use_mesh(self.mesh):
            start = time.perf_counter()
            self.compiled = lower_train_step(self.layout, self.run).compile()
            self.compile_s = time.perf_counter() - start

    def memory(self) -> dict:
        """XLA's per-device bytes of the compiled step."""
        m = compiled_memory(self.compiled)
        return {key: m[key] for key in ("peak_bytes", "temp_bytes", "argument_bytes")}

    def collective_bytes(self) -> dict[str, int]:
        """Bytes of each collective's results per device, from the compiled HLO (a loop's body
        counted once)."""
        totals = dict.fromkeys(COLLECTIVES, 0)
        pattern = re.compile(r"= (\(?[^=]*?\)?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
        for shapes, kind in pattern.findall(self.compiled.as_text()):
            for dtype, dims in re.findall(r"(\w+)\[([0-9,]*)\]", shapes):
                count = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                totals[kind] += count * DTYPE_BYTES.get(dtype, 4)
        return totals

    def timed(self, steps: int) -> dict:
        """Median seconds of `steps` steps after a warm-up, and the collectives' share of the
        devices' time in a profiled step."""
        training = self.layout.training
        with use_mesh(self.mesh):
            state = jax.jit(lambda: create_state(training.model, training.optimizer,
                                                 self.run.train.seed),
                            out_shardings=self.layout.state_sharding)()
            batch = {k: jax.device_put(v, self.layout.batch_sharding)
                     for k, v in self.data.items()}
            flag = np.bool_(False)
            state, metrics = self.compiled(state, batch, flag)
            loss = float(metrics["loss"])
            seconds = []
            for _ in range(steps):
                start = time.perf_counter()
                state, metrics = self.compiled(state, batch, flag)
                jax.block_until_ready(metrics)
                seconds.append(time.perf_counter() - start)
            with tempfile.TemporaryDirectory() as trace_dir:
                start = time.perf_counter()
                with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                    state, metrics = self.compiled(state, batch, flag)
                    jax.block_until_ready(metrics)
                profiled = time.perf_counter() - start
                share = collective_share(trace_dir, len(self.mesh.devices.flat), profiled)
        return {"step_seconds": statistics.median(seconds), "all_step_seconds": seconds,
                "first_loss": loss, "collective_share": share}


def collective_share(trace_dir: str, devices: int, wall: float) -> float:
    """Σ durations of the collective events in a perfetto trace / (devices x wall)."""
    path = next(Path(trace_dir).rglob("*.json.gz"))
    trace = json.loads(gzip.open(path).read())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    busy = sum(e.get("dur", 0) for e in events
               if e.get("ph") == "X" and e.get("name", "").split(".")[0] in COLLECTIVES)
    return busy * 1e-6 / (devices * wall)


def measure(family: str, length: int, context: int, steps: int, timed: bool) -> dict:
    step = Step(family, length, context)
    row = {"family": family, "length": length, "context": context,
           "compile_s": step.compile_s, **step.memory()}
    if context > 1:
        row["collective_bytes"] = step.collective_bytes()
        row["planned_context_terms"] = context_layer_bytes(step.run.model, length, 1, context)
    if timed:
        row.update(step.timed(steps))
    print(json.dumps({k: v for k, v in row.items() if k != "planned_context_terms"}),
          flush=True)
    return row


def one_device(family: str, budget: float, lengths: list[int], steps: int,
               time_up_to: int) -> list[dict]:
    """One device at every power of two from the shortest length until one does not fit
    `budget` bytes or the longest length is reached (compiled only), the longest that fits also
    timed."""
    rows, length = [], min(lengths)
    while length <= max(lengths) and (not rows or rows[-1]["peak_bytes"] <= budget):
        rows.append(measure(family, length, 1, steps, timed=False))
        length *= 2
    fitting = [r for r in rows if r["peak_bytes"] <= budget and r["length"] <= time_up_to]
    if fitting:
        rows[rows.index(fitting[-1])] = measure(family, fitting[-1]["length"], 1, steps, True)
    return rows


def run_benchmark(args) -> None:
    budget = args.budget_gib * GIB
    results = {"budget_gib": args.budget_gib, "context": args.context, "families": {}}
    for family in args.families:
        single = one_device(family, budget, args.lengths, args.steps, args.time_up_to)
        split = [measure(family, t, args.context, args.steps, t <= args.time_up_to)
                 for t in args.lengths]
        fits = [r["length"] for r in single if r["peak_bytes"] <= budget]
        results["families"][family] = {"one_device": single, "context": split,
                                       "longest_one_device": max(fits, default=None)}
    path = save("context_parallel", results)
    for family, data in results["families"].items():
        print(f"\n{family}: longest on one device within {args.budget_gib} GiB: "
              f"{data['longest_one_device']}")
        print(markdown_table(
            ["T", "devices", "peak MiB/device", "step s", "collective share"],
            [[r["length"], r["context"], f"{r['peak_bytes'] / 2**20:.0f}",
              f"{r['step_seconds']:.2f}" if "step_seconds" in r else "-",
              f"{r['collective_share']:.0%}" if "collective_share" in r else "-"]
             for r in data["one_device"] + data["context"]]))
    print(f"\nwrote {path}")
