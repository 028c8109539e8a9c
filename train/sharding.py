"""Device mesh and sharding rules: one table maps every logical axis name to mesh axes.

    mesh = make_mesh(run.mesh)                       # axes pipeline, data, fsdp, expert, tensor
    with use_mesh(mesh):                             # mesh + rules context for tracing
        shardings = state_shardings(training, abstract, mesh, run)
        step = jax.jit(step_fn, in_shardings=(shardings, batch_sharding(mesh), None), ...)

Decoupled layouts (report 3.2): attention and dense weights shard over `fsdp` (the `embed`
axis) and `tensor` (heads, FFN hidden, vocabulary); routed experts shard over `expert`. Tokens
shard over `data`, `fsdp` and `expert` together, so the expert axis is data parallelism for
everything but the routed experts (model/expert_parallel.py moves tokens to their experts).
The longest scanned layer segment shards its `layers` axis over `pipeline` (model/pipeline.py).
ZeRO-1 (`mesh.zero1`) additionally shards optimizer state over `data`.

A mesh axis that does not divide a dimension is left out of that dimension's spec (the array
is then replicated along it), so small test models run on any mesh.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from model.config import ModelConfig
from model.parallel import spec_axes
from model.pipeline import num_microbatches, pipelined_segment
from train.config import MESH_AXES, MeshConfig, RunConfig

BATCH_AXES = ("data", "fsdp", "expert")

# logical axis -> mesh axes (model/common.py lists the logical names).
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("length", None),
    ("act_embed", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mtp_concat", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("norm", None),
    ("layers", None),  # `pipeline` for the pipelined segment, see param_specs
)


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """Mesh over `devices` (default: all, every process's) with axes MESH_AXES, all Auto
    (GSPMD propagates shardings; shard_map regions take the axes they need)."""
    devices = jax.devices() if devices is None else devices
    sizes = cfg.axis_sizes(len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    if len(devices) == len(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                             devices=devices)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    """A mesh of `sizes` ({axis: size} over MESH_AXES, missing axes 1) without devices: enough
    for the specs below (planning a pod on one machine)."""
    return AbstractMesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(MESH_AXES))


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """The mesh and the logical-axis rules, as the model reads them while tracing."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_RULES):
        yield mesh


def logical_to_spec(axes: tuple, shape: tuple[int, ...], mesh: Mesh,
                    rules=LOGICAL_RULES) -> P:
    """PartitionSpec for an array with logical `axes` and `shape`: each dimension takes the mesh
    axes its rule names, skipping size-1 axes, axes already used by an earlier dimension and
    axes that would not divide the dimension."""
    table = dict(rules)
    used: set[str] = set()
    entries = []
    for name, size in zip(axes, shape):
        chosen = []
        for axis in spec_axes(table.get(name)):
            width = mesh.shape[axis] * math.prod(mesh.shape[a] for a in chosen)
            if mesh.shape[axis] > 1 and axis not in used and size % width == 0:
                chosen.append(axis)
        used.update(chosen)
        entries.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return P(*entries)


def _path_keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def param_specs(axes_tree: Any, shapes: Any, mesh: Mesh, cfg: ModelConfig) -> Any:
    """Tree of PartitionSpecs for the params (or any collection with logical axes).

    axes_tree: logical-axis tuples (train.optimizer.param_axes); shapes: matching tree of arrays
    or ShapeDtypeStructs. The pipelined segment's `layers` axis goes to `pipeline`.
    """
    stages = mesh.shape["pipeline"]
    piped = pipelined_segment(cfg, stages) if stages > 1 else None

    def spec(path, axes, leaf):
        keys = _path_keys(path)
        rules = LOGICAL_RULES
        if piped is not None and keys[:2] == ("layers", f"segment_{piped}"):
            rules = LOGICAL_RULES + (("layers", "pipeline"),)  # later entries win
        return logical_to_spec(axes, leaf.shape, mesh, rules)

    return jax.tree_util.tree_map_with_path(spec, axes_tree, shapes,
                                            is_leaf=lambda x: isinstance(x, tuple))


def zero1_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """`spec` with `data` added to the largest dimension it still divides (ZeRO-1: each data
    replica keeps 1/data of the optimizer state). Unchanged if `data` is used or fits nowhere."""
    data = mesh.shape["data"]
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if data == 1 or any("data" in spec_axes(e) for e in entries):
        return spec
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        current = spec_axes(entries[dim])
        if shape[dim] % (data * math.prod(mesh.shape[a] for a in current)) == 0:
            entries[dim] = (*current, "data") if current else "data"
            return P(*entries)
    return spec


def opt_state_specs(opt_state: Any, params: Any, specs: Any, mesh: Mesh, zero1: bool) -> Any:
    """Specs for an optax state: a leaf whose key path ends with a param's path and has its
    shape (Adam moments, Muon momentum) takes that param's spec (plus ZeRO-1); the rest (step
    counts, masked-out placeholders) is replicated."""
    by_path = {}
    for (path, spec), leaf in zip(
            jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0],
            jax.tree.leaves(params)):
        by_path[_path_keys(path)] = (spec, leaf.shape)

    def spec_of(path, leaf):
        keys = _path_keys(path)
        for start in range(len(keys)):
            match = by_path.get(keys[start:])
            if match is not None and match[1] == leaf.shape:
                return zero1_spec(match[0], leaf.shape, mesh) if zero1 else match[0]
        return P()

    return jax.tree_util.tree_map_with_path(spec_of, opt_state)


def state_specs(abstract_state: Any, variable_axes: dict, mesh: Mesh, run: RunConfig) -> Any:
    """PartitionSpecs of a `TrainState` (same structure). variable_axes: {'params': axes tree,
    'balance': axes tree} (logical axes of both collections)."""
    params = param_specs(variable_axes["params"], abstract_state.params, mesh, run.model)
    balance = (param_specs(variable_axes["balance"], abstract_state.balance, mesh, run.model)
               if abstract_state.balance else abstract_state.balance)
    return abstract_state.replace(
        step=P(), rng=P(), skipped=P(), consecutive_skips=P(), params=params, balance=balance,
        opt_state=opt_state_specs(abstract_state.opt_state, abstract_state.params, params, mesh,
                                  run.mesh.zero1))


def named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_spec(mesh: Mesh) -> P:
    """[num_micro, micro_batch, T] batches: rows over data, fsdp and expert."""
    return P(None, tuple(a for a in BATCH_AXES if mesh.shape[a] > 1) or None, None)


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batch_fits(run: RunConfig, mesh: Mesh) -> None:
    """Every micro-batch must split evenly over the data-parallel devices and into the
    pipeline's micro-batches."""
    ways = data_parallel_size(mesh)
    micro = run.train.micro_batch()
    if micro % ways:
        raise ValueError(f"train.micro_batch_size: {micro} sequences do not split over the "
                         f"{ways} data-parallel devices (mesh data x fsdp x expert)")
    stages = mesh.shape["pipeline"]
    if stages > 1:
        pieces = num_microbatches(run.model, stages)
        if micro % pieces or (micro // pieces) % ways:
            raise ValueError(
                f"model.pipeline_microbatches: {micro} sequences per micro-batch do not split "
                f"into {pieces} pipeline micro-batches of a multiple of {ways} sequences")
