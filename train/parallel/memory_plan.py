"""The memory planner behind `python -m train.plan` (whose command line and table are
`plan.py`): state bytes, the activation estimate and `plan_memory`.

The state's shapes come from `jax.eval_shape` (train/state.py) and its PartitionSpecs from the
training's own sharding rules (train/parallel/sharding.py `state_specs`) applied to a
`jax.sharding.AbstractMesh`. Per-device bytes of an array =
prod(shape) / prod(mesh sizes of the axes in its spec) * itemsize.

Rows (per device):
- params: the `params` collection (param_dtype, sharded like training shards it: `embed` over
  fsdp, heads/FFN/vocab over tensor, routed experts over expert, the pipelined segment's
  `layers` axis over pipeline).
- optimizer state: every optax leaf (Muon momentum, Adam moments, counts), with ZeRO-1
  (`mesh.zero1`) sharding it over `data` as well.
- gradients: one param-shaped float32 tree sharded like the params; two when the step
  accumulates gradients over several micro-batches (train.batch_size > micro-batch: the
  running sum and the current micro-batch's gradient are both live).
- other state: the `balance` collection (router biases), step, rng.
- activations: an ESTIMATE (train/parallel/activation_plan.py), not a measurement; XLA's buffer
  assignment, fusion and collective buffers move the real peak either way; `--measure` shows
  XLA's figure for the same step.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import jax
import numpy as np
from flax.traverse_util import flatten_dict
from jax.sharding import PartitionSpec as P

from model.parallel.expert_parallel import resolve_collective
from model.parallel.mesh import spec_axes
from model.parallel.pipeline import pipelined_segment, stage_plan
from model.parallel.rules import abstract_mesh
from model.summary import param_group
from train.config import RunConfig
from train.parallel import pipeline_plan
from train.parallel.activation_plan import activation_bytes
from train.parallel.sharding import check_batch_fits, data_parallel_size, state_specs
from train.state import abstract_state, build_training

GIB = 2**30


class PlanError(ValueError):
    """A mesh/config combination that training would refuse (exit code 2 on the CLI)."""


def format_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


# ---- state bytes -----------------------------------------------------------------------------


_STATE_CACHE: dict[str, tuple] = {}
# Fields that change how a step runs, not the state's shapes (`--fit` varies them)
_LAYOUT_FIELDS = {"model": {"remat_policy", "pipeline_microbatches", "pipeline_virtual_stages"},
                  "train": {"batch_size", "micro_batch_size", "batch_warmup"}}


def _training_and_state(run: RunConfig) -> tuple:
    """(Training, abstract TrainState); cached per model + train config up to the layout's
    fields (the mesh does not change shapes either), so planning many layouts traces the model
    once."""
    config = run.to_dict()
    key = json.dumps({section: {k: v for k, v in config[section].items() if k not in skip}
                      for section, skip in _LAYOUT_FIELDS.items()}, sort_keys=True, default=str)
    if key not in _STATE_CACHE:
        training = build_training(run)
        _STATE_CACHE[key] = (training, abstract_state(training, run.train.seed))
    return _STATE_CACHE[key]


def sharded_bytes(shape: Sequence[int], dtype: Any, spec: P, sizes: dict[str, int]) -> int:
    """Bytes one device holds of an array of `shape` laid out by `spec` on a mesh of `sizes`."""
    ways = math.prod(sizes[a] for entry in spec for a in spec_axes(entry))
    return math.prod(shape) * np.dtype(dtype).itemsize // ways


def _tree_bytes(tree: Any, specs: Any, sizes: dict[str, int]) -> int:
    leaves = jax.tree.leaves(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(leaves) == len(spec_leaves), (len(leaves), len(spec_leaves))
    return sum(sharded_bytes(x.shape, x.dtype, s, sizes) for x, s in zip(leaves, spec_leaves))


def state_bytes(run: RunConfig, sizes: dict[str, int]) -> dict:
    """Per-device bytes of params / optimizer state / other state, params per group and per
    scanned layer segment, and the global parameter count."""
    training, state = _training_and_state(run)
    specs = state_specs(state, training.variable_axes, abstract_mesh(sizes), run)
    groups: dict[str, int] = {}
    segments: dict[int, int] = {}  # scanned segment index -> its params' bytes
    flat_params = flatten_dict(state.params)
    flat_specs = flatten_dict(specs.params, is_leaf=lambda _, x: isinstance(x, P))
    for path, leaf in flat_params.items():
        keys = tuple(str(k) for k in path)
        size = sharded_bytes(leaf.shape, leaf.dtype, flat_specs[path], sizes)
        group = param_group(keys)
        groups[group] = groups.get(group, 0) + size
        if keys[0] == "layers" and keys[1].startswith("segment_"):
            index = int(keys[1].removeprefix("segment_"))
            segments[index] = segments.get(index, 0) + size
    other = sum(_tree_bytes(getattr(state, name), getattr(specs, name), sizes)
                for name in ("balance", "step", "rng", "skipped", "consecutive_skips"))
    return {
        "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)),
        "params": sum(groups.values()),
        "params_by_group": dict(sorted(groups.items())),
        "segments": segments,
        "optimizer": _tree_bytes(state.opt_state, specs.opt_state, sizes),
        "other": other,
    }


# ---- the plan --------------------------------------------------------------------------------


def device_rows(run: RunConfig, sizes: dict[str, int], state: dict) -> dict:
    """Per-device rows of `run` on a mesh of `sizes` from its `state_bytes`: {"per_device":
    {params, optimizer_state, gradients, other_state, activations}, "activations" (total, parts,
    rows and tokens per device; with a pipeline, its stage-layout copy), "accumulation_steps",
    "gradient_copies"}."""
    accumulation = max(run.train.batch_sizes()) // run.train.micro_batch()
    gradient_copies = 2 if accumulation > 1 else 1
    activations = activation_bytes(run, sizes)
    stages = sizes["pipeline"]
    if stages > 1:
        segment_bytes = state["segments"][pipelined_segment(run.model, stages)]
        copy = pipeline_plan.stage_copy_bytes(stage_plan(run.model, stages), segment_bytes)
        if copy:
            activations["parts"]["pipeline_stage_params"] = copy
            activations["total"] += copy
    per_device = {"params": state["params"], "optimizer_state": state["optimizer"],
                  "gradients": gradient_copies * state["params"], "other_state": state["other"],
                  "activations": activations["total"]}
    return {"per_device": per_device, "activations": activations,
            "accumulation_steps": accumulation, "gradient_copies": gradient_copies}


def plan_memory(run: RunConfig, sizes: dict[str, int], device_memory_gib: float = 80.0) -> dict:
    """The memory plan of `run` on a mesh of `sizes` ({axis: size}, -1 resolved): a JSON-able
    dict. Raises PlanError when training would refuse the mesh (pipeline vs layer plan)."""
    mesh = abstract_mesh(sizes)
    warnings = []
    stages = sizes["pipeline"]
    pipeline = None
    if stages > 1:
        try:
            pipeline = pipeline_plan.describe(run, stages)
        except ValueError as err:
            raise PlanError(str(err)) from None
    try:
        check_batch_fits(run, mesh)
    except ValueError as err:
        warnings.append(f"{err} (the plan assumes the rows per device rounded up)")

    state = state_bytes(run, sizes)
    rows = device_rows(run, sizes, state)
    per_device, activations = rows["per_device"], rows["activations"]
    if pipeline:
        fixed = sum(v for k, v in per_device.items() if k != "activations")
        pipeline["schedules"] = pipeline_plan.schedules(
            run, sizes, state["segments"][pipeline["segment"]], fixed, activation_bytes)
    total = sum(per_device.values())
    budget = int(device_memory_gib * GIB)
    within = total <= budget
    if not within:
        warnings.append(f"over budget: {total / GIB:.2f} GiB per device needed, "
                        f"{device_memory_gib:g} GiB available (--device-memory)")
    return {
        "mesh": dict(sizes), "devices": math.prod(sizes.values()), "zero1": run.mesh.zero1,
        "data_parallel_size": data_parallel_size(mesh),
        "num_params": state["num_params"], "param_dtype": run.model.param_dtype,
        "compute_dtype": run.model.compute_dtype, "remat_policy": run.model.remat_policy,
        "attention_impl": run.model.attention_impl,
        "ep_collective": resolve_collective(run.model.ep_collective),
        "batch_size": run.train.batch_size, "micro_batch_size": run.train.micro_batch(),
        "accumulation_steps": rows["accumulation_steps"], "seq_len": run.train.seq_len,
        "rows_per_device": activations["rows_per_device"],
        "tokens_per_device": activations["tokens_per_device"],
        "pipeline": pipeline,
        "per_device_bytes": {**per_device, "total": total},
        "params_by_group_bytes": state["params_by_group"],
        "activation_parts_bytes": activations["parts"],
        "working_sets_bytes": activations["working_sets"],
        "gradient_copies": rows["gradient_copies"],
        "budget_bytes": budget, "within_budget": within,
        "utilisation": total / budget if budget else math.inf,
        "warnings": warnings,
    }
