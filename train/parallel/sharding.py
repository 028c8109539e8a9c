"""The training mesh and the layout of everything a train step holds.

    mesh = make_mesh(run.mesh)                       # axes pipeline, data, fsdp, expert, tensor
    with use_mesh(mesh):                             # model.parallel.rules: mesh + rules context
        specs = state_specs(abstract, variable_axes, mesh, run)
        step = jax.jit(step_fn, in_shardings=(named(mesh, specs), batch_sharding, None), ...)

Params follow the model's rules table (`model.parallel.rules`); here the optimizer state takes
its param's layout, ZeRO-1 (`mesh.zero1`) additionally shards it over `data` (report 3.2), and
batches split over the data-parallel axes. Under mixed precision ZeRO-1 shards the float32
params too: they are then the master weights, and each step computes with a gathered
compute-dtype copy (train/parallel/compute_params.py).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from model.parallel.context import AXIS as CONTEXT
from model.parallel.context import context_layout
from model.parallel.device_mesh import mesh_over
from model.parallel.mesh import spec_axes
from model.parallel.pipeline import num_microbatches, stage_plan
from model.parallel.rules import BATCH_AXES, add_axis, param_specs, path_keys
from train.config import MeshConfig, RunConfig
from train.parallel.compute_params import mixed_precision


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """Mesh over `devices` (default: all, every process's) with axes MESH_AXES, all Auto
    (GSPMD propagates shardings; shard_map regions take the axes they need)."""
    devices = jax.devices() if devices is None else devices
    return mesh_over(cfg.axis_sizes(len(devices)), devices)


def zero1_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """`spec` with `data` added to the largest dimension it still divides (ZeRO-1: each data
    replica keeps 1/data of the optimizer state). Unchanged if `data` is used or fits nowhere."""
    return add_axis(spec, shape, mesh, "data")


def opt_state_specs(opt_state: Any, params: Any, specs: Any, mesh: Mesh, zero1: bool) -> Any:
    """Specs for an optax state: a leaf whose key path ends with a param's path and has its
    shape (Adam moments, Muon momentum) takes that param's spec (plus ZeRO-1); the rest (step
    counts, masked-out placeholders) is replicated."""
    by_path = {}
    for (path, spec), leaf in zip(
            jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0],
            jax.tree.leaves(params)):
        by_path[path_keys(path)] = (spec, leaf.shape)

    def spec_of(path, leaf):
        keys = path_keys(path)
        for start in range(len(keys)):
            match = by_path.get(keys[start:])
            if match is not None and match[1] == leaf.shape:
                return zero1_spec(match[0], leaf.shape, mesh) if zero1 else match[0]
        return P()

    return jax.tree_util.tree_map_with_path(spec_of, opt_state)


def state_specs(abstract_state: Any, variable_axes: dict, mesh: Mesh, run: RunConfig) -> Any:
    """PartitionSpecs of a training run's `TrainState` (same structure). variable_axes:
    {'params': axes tree, 'balance': axes tree} (logical axes of both collections)."""
    return model_state_specs(abstract_state, variable_axes, mesh, run.model, run.mesh.zero1,
                             shard_params=shards_master_weights(run))


def shards_master_weights(run: RunConfig) -> bool:
    """Whether the stored params are float32 master weights sharded over `data` (ZeRO-1 under
    mixed precision; train/parallel/compute_params.py)."""
    return run.mesh.zero1 and mixed_precision(run.model)


def model_state_specs(abstract_state: Any, variable_axes: dict, mesh: Mesh, model: ModelConfig,
                      zero1: bool, shard_params: bool = False) -> Any:
    """`state_specs` of any model's `TrainState` (RL's actor and critic too): params and
    balance by the rules table, the optimizer state like its params (+ ZeRO-1 if `zero1`);
    `shard_params`: the params over `data` as well (master weights)."""
    params = stored_param_specs(variable_axes["params"], abstract_state.params, mesh, model,
                                shard_params)
    balance = (param_specs(variable_axes["balance"], abstract_state.balance, mesh, model)
               if abstract_state.balance else abstract_state.balance)
    return abstract_state.replace(
        step=P(), rng=P(), skipped=P(), consecutive_skips=P(), params=params, balance=balance,
        opt_state=opt_state_specs(abstract_state.opt_state, abstract_state.params, params, mesh,
                                  zero1))


def stored_param_specs(axes: Any, params: Any, mesh: Mesh, model: ModelConfig,
                       shard_params: bool) -> Any:
    """Specs of the stored params (logical `axes`, shapes `params`): the rules table, plus
    `data` on the largest dimension it divides when `shard_params` (ZeRO-1 master weights)."""
    specs = param_specs(axes, params, mesh, model)
    if not shard_params:
        return specs
    return jax.tree.map(lambda s, x: zero1_spec(s, x.shape, mesh), specs, params,
                        is_leaf=lambda x: isinstance(x, P))


def sharded_bytes(shape: Sequence[int], dtype: Any, spec: P, sizes: Mapping[str, int]) -> int:
    """Bytes one device holds of an array of `shape` laid out by `spec` on a mesh of `sizes`."""
    ways = math.prod(sizes[a] for entry in spec for a in spec_axes(entry))
    return math.prod(shape) * np.dtype(dtype).itemsize // ways


def batch_spec(mesh: Mesh) -> P:
    """[num_micro, micro_batch, T] batches: rows over pipeline, data, fsdp and expert, each
    row's tokens over `context` (contiguous chunks in natural order; the model reorders them)."""
    return P(None, tuple(a for a in BATCH_AXES if mesh.shape[a] > 1) or None,
             CONTEXT if mesh.shape[CONTEXT] > 1 else None)


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def row_shards(sizes: Mapping[str, int]) -> int:
    """Devices one pipeline stage's rows split over: data x fsdp x expert (the batch axes but
    `pipeline`); `sizes`: a mesh's shape or a plan's {axis: size}."""
    return math.prod(sizes[a] for a in BATCH_AXES if a != "pipeline")


def check_batch_fits(run: RunConfig, mesh: Mesh) -> None:
    """Every micro-batch must split evenly over the data-parallel devices (the pipeline's too,
    outside the pipelined segment) and into the pipeline's micro-batches, each of which splits
    over the data-parallel devices of one stage; the pipeline's stage plan must fit the layers."""
    ways = data_parallel_size(mesh)
    micro = run.train.micro_batch()
    if micro % ways:
        raise ValueError(f"train.micro_batch_size: {micro} sequences do not split over the "
                         f"{ways} data-parallel devices (mesh pipeline x data x fsdp x expert)")
    chunks = context_layout(run.model, mesh.shape[CONTEXT]).chunks
    if run.train.seq_len % chunks:
        raise ValueError(f"train.seq_len: {run.train.seq_len} tokens do not split into the "
                         f"{chunks} chunks of mesh.context={mesh.shape[CONTEXT]} "
                         f"(model.context_layout)")
    stages = mesh.shape["pipeline"]
    if stages > 1:
        stage_plan(run.model, stages)  # the layer plan and virtual stages fit the stages
        pieces = num_microbatches(run.model, stages)
        ways = row_shards(mesh.shape)  # a pipeline micro-batch splits over one stage's devices
        if micro % pieces or (micro // pieces) % ways:
            raise ValueError(
                f"model.pipeline_microbatches: {micro} sequences per micro-batch do not split "
                f"into {pieces} pipeline micro-batches of a multiple of {ways} sequences")
