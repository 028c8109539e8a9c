"""`python -m train.plan --fit`: the layouts of a run that fit N devices of a given memory,
fastest first by the estimated step time of train/parallel/step_time.py.

Search, for the run's global batch (train.batch_size) and sequence length:
- meshes: pipeline S = 1 or a stage count up to 16 that divides the devices and that the layer
  plan splits (a scanned segment of at least S repeats); expert e a power of two dividing
  moe.num_experts; tensor t in 1, 2, 4, 8 within a node, dividing every head count; fsdp f a
  power of two; data the remaining devices; context 1 (sequences stay whole). For each (S, e)
  only the smallest t with a fitting layout (tensor parallelism as far as memory needs it), and
  for each (S, e, t) the smallest f with one and its next two doublings (more fsdp trades
  communication for memory).
- per mesh: pipeline micro-batches M in S, 2 S, 4 S and virtual stages V = 1 and the most that
  keep GPipe's repeat slots per device (`pipeline_plan.free_virtual_stages`); every remat
  policy; with each, the fewest gradient-accumulation steps a, a power of two
  (train.micro_batch_size = batch / a), that fit. A layout must pass training's own checks
  (`check_batch_fits`, the stage plan).
Each mesh and schedule shows its fastest fitting remat policy and accumulation; the fastest
`top` of those are printed. A layout fits when the planner's per-device total
(train/parallel/memory_plan.py) is within the device memory; model.ep_collective=auto counts
as `ragged`, what GPUs and TPUs run. The state rows are computed once per mesh, the activation
rows per layout.
"""

from __future__ import annotations

import dataclasses
import functools

from model.config import REMAT_POLICIES, SHARED_KV_KINDS
from model.config.cli import format_table
from model.layers.layer_plan import layer_kinds, plan_segments
from model.parallel.pipeline import stage_plan
from model.parallel.rules import MESH_AXES, abstract_mesh
from train.config import RunConfig
from train.parallel.memory_plan import GIB, device_rows, state_bytes
from train.parallel.pipeline_plan import free_virtual_stages
from train.parallel.sharding import check_batch_fits, row_shards
from train.parallel.step_time import Hardware, step_time

MAX_STAGES = 16
TENSOR_SIZES = (1, 2, 4, 8)
FSDP_DOUBLINGS = 2  # meshes tried beyond the smallest fsdp that fits


def powers_of_two(n: int) -> list[int]:
    """Powers of two dividing n, ascending."""
    return [1 << i for i in range(n.bit_length()) if n % (1 << i) == 0]


def stage_counts(run: RunConfig, devices: int) -> list[int]:
    if not run.model.scan_layers:
        return [1]
    repeats = max(seg.repeats for seg in plan_segments(layer_kinds(run.model)))
    return [1] + [s for s in range(2, min(MAX_STAGES, repeats) + 1) if devices % s == 0]


def tensor_sizes(run: RunConfig, node_size: int) -> list[int]:
    cfg = run.model
    kinds = {k.attention_type for k in layer_kinds(cfg)}
    heads = [cfg.shared_kv_attention.num_heads if kind in SHARED_KV_KINDS else
             cfg.attention_geometry(kind).num_heads for kind in kinds]
    return [t for t in TENSOR_SIZES if t <= node_size and all(h % t == 0 for h in heads)]


def expert_sizes(run: RunConfig) -> list[int]:
    return powers_of_two(run.model.moe.num_experts) if run.model.moe_layer_indices() else [1]


class Search:
    """The layouts of `run` on `devices` devices of `budget` bytes (module docstring)."""

    def __init__(self, run: RunConfig, devices: int, budget: int, hardware: Hardware):
        if run.model.ep_collective == "auto":  # the accelerators' choice, wherever this runs
            run = dataclasses.replace(run, model=run.model.replace(ep_collective="ragged"))
        self.run, self.devices, self.budget, self.hardware = run, devices, budget, hardware
        self.states: dict[tuple, dict] = {}
        self.configs: dict[tuple, object] = {}  # model / train variants, built once each
        self.evaluated = 0  # layouts whose memory was planned

    def _config(self, key: tuple, build):
        if key not in self.configs:
            self.configs[key] = build()
        return self.configs[key]

    def laid_out(self, sizes: dict[str, int], remat: str, microbatches: int, virtual: int,
                 accumulation: int) -> RunConfig | None:
        """The run in this layout, or None when its batch does not split as training needs
        (`check_batch_fits`, here in arithmetic: it is the search's inner loop)."""
        batch, ways = self.run.train.batch_size, row_shards(sizes)
        pieces = microbatches if sizes["pipeline"] > 1 else 1
        micro, left = divmod(batch, accumulation)
        if left or micro % pieces or (micro // pieces) % ways:
            return None
        model = self._config(("model", remat, microbatches, virtual),
                             lambda: self.run.model.replace(
                                 remat_policy=remat, pipeline_microbatches=microbatches,
                                 pipeline_virtual_stages=virtual))
        train = self._config(("train", micro), lambda: dataclasses.replace(
            self.run.train, micro_batch_size=micro, batch_warmup=()))
        return dataclasses.replace(self.run, model=model, train=train,
                                   mesh=dataclasses.replace(self.run.mesh, **sizes))

    def total(self, layout: RunConfig, sizes: dict[str, int]) -> tuple[int, dict]:
        key = (layout.model.pipeline_virtual_stages, tuple(sizes.items()))
        if key not in self.states:
            self.states[key] = state_bytes(layout, sizes)
        self.evaluated += 1
        rows = device_rows(layout, sizes, self.states[key])
        return sum(rows["per_device"].values()), rows

    @functools.lru_cache(maxsize=None)  # noqa: B019 (one Search per command)
    def schedules(self, stages: int) -> list[tuple[int, int]]:
        """(micro-batches M, virtual stages V) to try on `stages` stages."""
        if stages == 1:
            return [(0, 1)]
        out = []
        for microbatches in (stages, 2 * stages, 4 * stages):
            plan = stage_plan(self.run.model.replace(pipeline_microbatches=microbatches,
                                                     pipeline_virtual_stages=1), stages)
            out += [(microbatches, v) for v in sorted({1, free_virtual_stages(plan)})]
        return out

    def fewest_steps(self, sizes: dict[str, int], remat: str, microbatches: int,
                     virtual: int) -> dict | None:
        """The layout with the fewest accumulation steps that fits, or None."""
        for accumulation in powers_of_two(self.run.train.batch_size):
            layout = self.laid_out(sizes, remat, microbatches, virtual, accumulation)
            if layout is None:
                continue
            total, rows = self.total(layout, sizes)
            if total <= self.budget:
                check_batch_fits(layout, abstract_mesh(sizes))  # what training checks
                return self.describe(layout, sizes, total, rows)
        return None

    def on_mesh(self, sizes: dict[str, int], first: bool = False) -> list[dict]:
        """Every fitting layout on the mesh `sizes` (one per schedule and remat policy; only
        the first found with `first`)."""
        out = []
        for microbatches, virtual in self.schedules(sizes["pipeline"]):
            for remat in REMAT_POLICIES:
                found = self.fewest_steps(sizes, remat, microbatches, virtual)
                if found:
                    out.append(found)
                    if first:
                        return out
        return out

    def describe(self, layout: RunConfig, sizes: dict[str, int], total: int, rows: dict) -> dict:
        time = step_time(layout, sizes, rows, self.hardware)
        tokens = layout.train.batch_size * layout.train.seq_len
        model, train = layout.model, layout.train
        overrides = [f"mesh.{a}={sizes[a]}" for a in MESH_AXES] + [
            f"model.remat_policy={model.remat_policy}",
            f"train.micro_batch_size={train.micro_batch_size}"]
        if sizes["pipeline"] > 1:
            overrides += [f"model.pipeline_microbatches={model.pipeline_microbatches}",
                          f"model.pipeline_virtual_stages={model.pipeline_virtual_stages}"]
        if sizes["expert"] > 1:  # the exchange planned, also where `auto` picks another
            overrides.append(f"model.ep_collective={model.ep_collective}")
        return {"mesh": dict(sizes), "remat_policy": model.remat_policy,
                "pipeline_microbatches": model.pipeline_microbatches if sizes["pipeline"] > 1
                else 0, "virtual_stages": model.pipeline_virtual_stages,
                "accumulation_steps": rows["accumulation_steps"], "memory_bytes": total,
                "step_seconds": time["seconds"], "compute_seconds": time["compute"],
                "bubble_fraction": time["bubble"],
                "exposed_communication_seconds": time["exposed_communication"],
                "tokens_per_second_per_device": tokens / time["seconds"] / self.devices,
                "overrides": overrides}

    def run_search(self) -> list[dict]:
        found = []
        tensors = tensor_sizes(self.run, self.hardware.node_size)
        for stages in stage_counts(self.run, self.devices):
            for expert in expert_sizes(self.run):
                for tensor in tensors:
                    rest, left = divmod(self.devices, stages * expert * tensor)
                    if left:
                        continue
                    layouts = self.smallest_fsdp(stages, expert, tensor, rest)
                    found += layouts
                    if layouts:
                        break
        # one layout per mesh and schedule: its fastest remat policy and accumulation
        best: dict[tuple, dict] = {}
        for layout in sorted(found, key=lambda x: (x["step_seconds"], x["memory_bytes"])):
            best.setdefault((tuple(layout["mesh"].values()), layout["pipeline_microbatches"],
                             layout["virtual_stages"]), layout)
        return list(best.values())

    def smallest_fsdp(self, stages: int, expert: int, tensor: int, rest: int) -> list[dict]:
        """Layouts on the smallest fsdp size with any and on its next doublings."""
        sizes = lambda f: {"pipeline": stages, "data": rest // f, "fsdp": f,  # noqa: E731
                           "expert": expert, "context": 1, "tensor": tensor}
        candidates = powers_of_two(rest)
        low, high, first = 0, len(candidates) - 1, None
        while low <= high:  # memory only falls as fsdp grows: bisect for the first fit
            middle = (low + high) // 2
            if self.on_mesh(sizes(candidates[middle]), first=True):
                first, high = middle, middle - 1
            else:
                low = middle + 1
        if first is None:
            return []
        return [layout for f in candidates[first:first + 1 + FSDP_DOUBLINGS]
                for layout in self.on_mesh(sizes(f))]


def fit(run: RunConfig, devices: int, device_memory_gib: float, hardware: Hardware,
        top: int = 5) -> dict:
    """The `top` fastest fitting layouts (JSON-able), with what was searched."""
    search = Search(run, devices, int(device_memory_gib * GIB), hardware)
    layouts = search.run_search()
    return {"devices": devices, "device_memory_bytes": search.budget,
            "batch_size": run.train.batch_size, "seq_len": run.train.seq_len,
            "hardware": dataclasses.asdict(hardware), "layouts_planned": search.evaluated,
            "meshes_planned": len(search.states), "fitting_layouts": len(layouts),
            "layouts": layouts[:top]}


def no_fit_reason(result: dict) -> str:
    """Why `fit` found nothing: no mesh splits the batch, or none fits the memory."""
    if not result["layouts_planned"]:
        return (f"no layout splits the batch of {result['batch_size']} sequences over "
                f"{result['devices']} devices (data x fsdp x expert must divide a micro-batch)")
    return f"no layout fits {result['device_memory_bytes'] / GIB:.4g} GiB per device"


def render_fit(result: dict, config: str) -> str:
    """The table of `fit`'s layouts and the overrides that train the fastest."""
    hw = result["hardware"]
    head = (f"layouts of {config} on {result['devices']} devices of "
            f"{result['device_memory_bytes'] / GIB:.4g} GiB, batch {result['batch_size']} x "
            f"{result['seq_len']} tokens: {result['fitting_layouts']} meshes and schedules fit "
            f"({result['layouts_planned']} layouts planned on {result['meshes_planned']} "
            "meshes)\n"
            f"step time at {hw['peak_tflops']:g} TFLOP/s x MFU {hw['mfu']:g}, links "
            f"{hw['intra_node_gbps']:g} GB/s within nodes of {hw['node_size']}, "
            f"{hw['inter_node_gbps']:g} GB/s between (train/parallel/step_time.py)")
    if not result["layouts"]:
        return head + "\n" + no_fit_reason(result)
    rows = [[str(i + 1), " ".join(f"{a[0]}{n}" for a, n in x["mesh"].items() if n > 1) or "1",
             x["remat_policy"], str(x["pipeline_microbatches"] or "-"),
             str(x["virtual_stages"]), str(x["accumulation_steps"]),
             f"{x['memory_bytes'] / GIB:.1f}", f"{x['step_seconds']:.2f}",
             f"{100 * x['bubble_fraction']:.0f}%", f"{x['exposed_communication_seconds']:.2f}",
             f"{x['tokens_per_second_per_device']:,.0f}"] for i, x in enumerate(result["layouts"])]
    table = format_table(["#", "mesh (p d f e t)", "remat", "M", "V", "accum", "GiB/device",
                          "step s", "bubble", "exposed comm s", "tokens/s/device"], rows)
    return (f"{head}\n\n{table}\n\nthe fastest: "
            + " ".join(result["layouts"][0]["overrides"]))
