"""Logical axes -> mesh axes: the one rules table of the model's shardings.

    with use_mesh(mesh):                         # mesh + rules context for tracing
        specs = param_specs(param_axes(boxed), shapes, mesh, cfg)

Decoupled layouts (report 3.2): attention and dense weights shard over `fsdp` (the `embed`
axis) and `tensor` (heads, FFN hidden, vocabulary); routed experts shard over `expert`. Tokens
shard over `pipeline`, `data`, `fsdp` and `expert` together, so the expert axis is data
parallelism for everything but the routed experts (`model.parallel.expert_parallel` moves tokens
to their experts) and the pipeline axis for everything outside the pipelined segment
(embeddings, the layers before and after it, the heads; inside the stages the rules drop
`pipeline`: `model.parallel.pipeline.stage_rules`). Activations split their sequence over
`context` (`model.parallel.context`; attention exchanges what crosses the shards). The
pipelined layer segment (`model.parallel.pipeline`) shards its `layers` axis over
`pipeline` when the stages hold contiguous, equal runs of its repeats; with virtual or uneven
stages, which rearrange the repeats every step, `pipeline` goes to the largest other dimension
it divides instead, so that rearranging is local and one all-to-all moves the result to the
stages.

A mesh axis that does not divide a dimension is left out of that dimension's spec (the array
is then replicated along it), so small test models run on any mesh. The trainer builds the
mesh and the optimizer-state layout on top of this (`train.parallel.sharding`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import flax.linen as nn
import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from model.parallel.mesh import spec_axes
from model.parallel.pipeline import pipelined_segment, stage_plan

MESH_AXES = ("pipeline", "data", "fsdp", "expert", "context", "tensor")  # outermost first
BATCH_AXES = ("pipeline", "data", "fsdp", "expert")

# logical axis -> mesh axes (`model.layers.common` lists the logical names).
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("length", "context"),  # one sequence split over `context` (model.parallel.context)
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


def path_keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def add_axis(spec: P, shape: tuple[int, ...], mesh, axis: str) -> P:
    """`spec` with mesh `axis` added to the largest dimension it still divides (with the axes
    already there); unchanged if `axis` is size 1, already used or fits nowhere."""
    size = mesh.shape[axis]
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if size == 1 or any(axis in spec_axes(e) for e in entries):
        return spec
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        current = spec_axes(entries[dim])
        if shape[dim] % (size * math.prod(mesh.shape[a] for a in current)) == 0:
            entries[dim] = (*current, axis) if current else axis
            return P(*entries)
    return spec


def param_specs(axes_tree: Any, shapes: Any, mesh: Mesh, cfg: ModelConfig) -> Any:
    """Tree of PartitionSpecs for the params (or any collection with logical axes).

    axes_tree: logical-axis tuples (`param_axes`); shapes: matching tree of arrays
    or ShapeDtypeStructs. The pipelined segment's `layers` axis goes to `pipeline` (module
    docstring: another dimension with virtual or uneven stages).
    """
    stages = mesh.shape["pipeline"]
    piped = pipelined_segment(cfg, stages) if stages > 1 else None
    contiguous = piped is not None and stage_plan(cfg, stages).contiguous

    def spec(path, axes, leaf):
        keys = path_keys(path)
        if piped is None or keys[:2] != ("layers", f"segment_{piped}"):
            return logical_to_spec(axes, leaf.shape, mesh)
        if contiguous:
            rules = LOGICAL_RULES + (("layers", "pipeline"),)  # later entries win
            return logical_to_spec(axes, leaf.shape, mesh, rules)
        return add_axis(logical_to_spec(axes, leaf.shape, mesh), leaf.shape, mesh, "pipeline")

    return jax.tree_util.tree_map_with_path(spec, axes_tree, shapes,
                                            is_leaf=lambda x: isinstance(x, tuple))


def named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def param_axes(boxed_variables: Any) -> Any:
    """Tree of logical-axis tuples for the `params` collection, e.g. ('layers', 'embed', 'heads',
    'head_dim'). Takes the boxed output of `CausalLM(cfg).init(...)` (or `jax.eval_shape` of it,
    or just its `params` entry)."""
    params = boxed_variables.get("params", boxed_variables)
    specs = nn.get_partition_spec(params)
    return jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
