"""The memory planner behind `python -m train.plan` (whose command line and table are
`plan.py`): state bytes, the activation estimate and `plan_memory`.

The state's shapes come from `jax.eval_shape` (train/state.py) and its PartitionSpecs from the
training's own sharding rules (train/parallel/sharding.py `state_specs`) applied to a
`jax.sharding.AbstractMesh`. Per-device bytes of an array =
prod(shape) / prod(mesh sizes of the axes in its spec) * itemsize.

Rows (per device):
- params: the `params` collection (param_dtype, sharded like training shards it: `embed` over
  fsdp, heads/FFN/vocab over tensor, routed experts over expert, the pipelined segment's
  `layers` axis over pipeline; float32 master weights of a mixed-precision model also over
  data under ZeRO-1).
- optimizer state: every optax leaf (Muon momentum, Adam moments, counts), with ZeRO-1
  (`mesh.zero1`) sharding it over `data` as well.
- compute copy and gradients (train/parallel/copy_plan.py): the copy of the params the step
  computes with (mixed precision, pipeline stage layout) and the gradients it forms: of the
  copy plus the float32 sum kept like the master weights, or param-shaped trees without a
  copy; a second sum when the step accumulates over micro-batches.
- other state: the `balance` collection (router biases), step, rng.
- activations: an ESTIMATE (train/parallel/activation_plan.py), not a measurement; XLA's buffer
  assignment, fusion and collective buffers move the real peak either way; `--measure` shows
  XLA's figure for the same step.
"""

from __future__ import annotations

import json
import math
from typing import Any

import jax
from flax.traverse_util import flatten_dict
from jax.sharding import PartitionSpec as P

from model.parallel.expert_parallel import resolve_collective
from model.parallel.rules import abstract_mesh
from model.summary import param_group
from train.config import RunConfig
from train.parallel import copy_plan, pipeline_plan
from train.parallel.activation_plan import activation_bytes
from train.parallel.sharding import (
    check_batch_fits,
    data_parallel_size,
    sharded_bytes,
    shards_master_weights,
    state_specs,
)
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
    """(Training, abstract TrainState, {(stages, virtual stages): `copy_plan.copy_shapes`});
    cached per model + train config up to the layout's fields (the mesh does not change shapes
    either), so planning many layouts traces the model once, and its compute copy once per
    stage layout."""
    config = run.to_dict()
    key = json.dumps({section: {k: v for k, v in config[section].items() if k not in skip}
                      for section, skip in _LAYOUT_FIELDS.items()}, sort_keys=True, default=str)
    if key not in _STATE_CACHE:
        training = build_training(run)
        _STATE_CACHE[key] = (training, abstract_state(training, run.train.seed), {})
    return _STATE_CACHE[key]


def _tree_bytes(tree: Any, specs: Any, sizes: dict[str, int]) -> int:
    leaves = jax.tree.leaves(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(leaves) == len(spec_leaves), (len(leaves), len(spec_leaves))
    return sum(sharded_bytes(x.shape, x.dtype, s, sizes) for x, s in zip(leaves, spec_leaves))


def state_bytes(run: RunConfig, sizes: dict[str, int]) -> dict:
    """Per-device bytes of params / optimizer state / other state, params per group, the
    step's compute copy of the params, and the global parameter count."""
    training, state, copies = _training_and_state(run)
    specs = state_specs(state, training.variable_axes, abstract_mesh(sizes), run)
    axes = training.variable_axes["params"]
    copy = 0
    if copy_plan.makes_copy(run, sizes):
        stages = sizes["pipeline"]
        layout = (stages, run.model.pipeline_virtual_stages)
        if layout not in copies:
            copies[layout] = copy_plan.copy_shapes(run, stages, axes, state.params)
        copy = copy_plan.compute_copy_bytes(run, sizes, axes, copies[layout], state.params,
                                            specs.params)
    groups: dict[str, int] = {}
    flat_params = flatten_dict(state.params)
    flat_specs = flatten_dict(specs.params, is_leaf=lambda _, x: isinstance(x, P))
    for path, leaf in flat_params.items():
        keys = tuple(str(k) for k in path)
        size = sharded_bytes(leaf.shape, leaf.dtype, flat_specs[path], sizes)
        group = param_group(keys)
        groups[group] = groups.get(group, 0) + size
    other = sum(_tree_bytes(getattr(state, name), getattr(specs, name), sizes)
                for name in ("balance", "step", "rng", "skipped", "consecutive_skips"))
    return {
        "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)),
        "params": sum(groups.values()),
        "params_by_group": dict(sorted(groups.items())),
        "compute_copy": copy,
        "optimizer": _tree_bytes(state.opt_state, specs.opt_state, sizes),
        "other": other,
    }


# ---- the plan --------------------------------------------------------------------------------


def device_rows(run: RunConfig, sizes: dict[str, int], state: dict) -> dict:
    """Per-device rows of `run` on a mesh of `sizes` from its `state_bytes`: {"per_device":
    {params, optimizer_state, compute_params, gradients, other_state, activations},
    "activations" (total, parts, working sets, rows and tokens per device),
    "accumulation_steps", "gradients_counted"}."""
    accumulation = max(run.train.batch_sizes()) // run.train.micro_batch()
    copy = state["compute_copy"]
    gradients, counted = copy_plan.gradient_bytes(copy, state["params"], accumulation)
    activations = activation_bytes(run, sizes)
    per_device = {"params": state["params"], "optimizer_state": state["optimizer"],
                  "compute_params": copy, "gradients": gradients, "other_state": state["other"],
                  "activations": activations["total"]}
    return {"per_device": per_device, "activations": activations,
            "accumulation_steps": accumulation, "gradients_counted": counted}


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
        virtual = run.model.pipeline_virtual_stages

        def variant_rows(variant: RunConfig) -> dict:  # the configured schedule's: `rows`
            if variant.model.pipeline_virtual_stages == virtual:
                return rows
            return device_rows(variant, sizes, state_bytes(variant, sizes))

        pipeline["schedules"] = pipeline_plan.schedules(run, sizes, variant_rows)
    total = sum(per_device.values())
    budget = int(device_memory_gib * GIB)
    within = total <= budget
    if not within:
        warnings.append(f"over budget: {total / GIB:.2f} GiB per device needed, "
                        f"{device_memory_gib:g} GiB available (--device-memory)")
    return {
        "mesh": dict(sizes), "devices": math.prod(sizes.values()), "zero1": run.mesh.zero1,
        "sharded_master": shards_master_weights(run) and sizes["data"] > 1,
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
        "gradients_counted": rows["gradients_counted"],
        "budget_bytes": budget, "within_budget": within,
        "utilisation": total / budget if budget else math.inf,
        "warnings": warnings,
    }
