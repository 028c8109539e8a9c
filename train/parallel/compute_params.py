"""The params as the train step computes with them: one copy per step, in the compute dtype and,
under a pipeline, with the pipelined segment in its stage layout; the gradients of that copy
come back to the stored params through its transpose (train/step.py).

    compute, to_stored = jax.vjp(lambda p: compute_params(p, axes, cfg), state.params)
    ... gradients g of the loss in `compute` ...
    grads = to_stored(g)[0]               # float32, laid out like state.params

Mixed precision (`mixed_precision`: model.compute_dtype narrower than model.param_dtype, as
bfloat16 under float32, the full presets): the stored params are the float32 master weights
and the copy holds the weight matrices in bfloat16. With mesh.zero1 the master weights are
sharded over `data` together with their optimizer state (train/parallel/sharding.py), as
DeepSpeed's ZeRO-1 and Megatron-LM's distributed optimizer keep master weights and moments:
each step all-gathers the bfloat16 copy (half the bytes of a float32 gather), and the
transpose of that gather reduce-scatters the gradients, so each device keeps 1/data of their
float32 sum. Params the model computes with in float32 stay float32 in the copy (router
kernels, norm weights, mHC mappings, attention sinks, the compressor's slot biases, FP4-QAT
experts: `casts_to_compute`); their bytes are negligible.

Pipeline (mesh.pipeline = S > 1): the pipelined segment's [R, ...] stacks become the stage
layout [S, V, k, ...] of model/parallel/pipeline.py in the copy itself, so a step holds one
arranged copy (and its gradient) instead of the stored stack plus a rearranged one per
micro-batch; the model reads it as such (`CausalLM(staged_pipeline=True)`).

MTP heads the loss does not run (`mtp_{h}` for h >= the trained heads, report 2.2: only MTP-1
trains in main training) stay out of the copy: they keep their stored layout, never gathered.
Without mixed precision or a pipeline the copy is the params themselves.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from model.layers.common import dtype_of
from model.parallel.pipeline import pipelined_segment, stage_layout, stage_plan
from model.parallel.rules import logical_to_spec, param_specs, path_keys
from model.summary import param_group
from train.optim.muon import batch_axes

# Param groups (model.summary.param_group) and names the model computes with in float32.
FLOAT32_GROUPS = frozenset({"router", "norms", "hyper_connections"})
FLOAT32_NAMES = frozenset({"position_bias"})  # the KV compressor's slot biases (added in f32)


def mixed_precision(cfg: ModelConfig) -> bool:
    """Whether the compute dtype is narrower than the stored params' (bfloat16 under float32)."""
    return dtype_of(cfg.compute_dtype).itemsize < dtype_of(cfg.param_dtype).itemsize


def casts_to_compute(keys: tuple[str, ...], axes: tuple[str, ...], cfg: ModelConfig) -> bool:
    """Whether the param at `keys` (logical `axes`) is a weight matrix the model computes with in
    model.compute_dtype, so that its copy may be held in that dtype."""
    if len(axes) - len(batch_axes(axes)) < 2:
        return False  # norm weights, sinks, gates, biases: vectors, used in float32
    inner = keys[1:] if keys[0].startswith("mtp_") else keys
    group = param_group(inner)
    if group in FLOAT32_GROUPS or keys[-1] in FLOAT32_NAMES:
        return False
    # FP4 QAT quantises the float32 master as the experts compute with it (model/layers/moe.py)
    return not (group == "moe_routed" and cfg.qat.expert_weights != "none")


def in_copy(keys: tuple[str, ...], mtp_heads: int | None) -> bool:
    """Whether the param at `keys` is part of the compute copy: all but the MTP heads from
    `mtp_heads` on (None: every head runs)."""
    head = keys[0].removeprefix("mtp_")
    return mtp_heads is None or head == keys[0] or int(head) < mtp_heads


def _piped_segment(cfg: ModelConfig, mesh) -> str | None:
    stages = 1 if mesh.empty else mesh.shape["pipeline"]
    return f"segment_{pipelined_segment(cfg, stages)}" if stages > 1 else None


def compute_specs(axes_tree: Any, shapes: Any, mesh, cfg: ModelConfig) -> Any:
    """PartitionSpecs of the compute copy of params with logical `axes_tree` and `shapes` (the
    stored ones): every param by the rules table alone (no ZeRO `data`), the pipelined
    segment's [S, V, k, ...] stage layout over `pipeline`."""
    piped = _piped_segment(cfg, mesh)

    def spec(path, axes, leaf):
        if piped is not None and path_keys(path)[:2] == ("layers", piped):
            return P("pipeline", None, None, *logical_to_spec(axes[1:], leaf.shape[1:], mesh))
        return logical_to_spec(axes, leaf.shape, mesh)

    return jax.tree_util.tree_map_with_path(spec, axes_tree, shapes,
                                            is_leaf=lambda x: isinstance(x, tuple))


def compute_params(params: Any, axes_tree: Any, cfg: ModelConfig,
                   mtp_heads: int | None = None) -> Any:
    """The step's copy of `params` (module docstring), traced under the mesh context
    (`model.parallel.rules.use_mesh`); without a mesh only the cast applies. `mtp_heads`: the
    MTP heads the step runs (`in_copy`)."""
    dtype = dtype_of(cfg.compute_dtype)
    narrow = mixed_precision(cfg)

    def cast(path, axes, p):
        keys = path_keys(path)
        if narrow and in_copy(keys, mtp_heads) and jnp.issubdtype(p.dtype, jnp.floating) and (
                casts_to_compute(keys, axes, cfg)):
            return p.astype(dtype)
        return p

    copy = jax.tree_util.tree_map_with_path(cast, axes_tree, params,
                                            is_leaf=lambda x: isinstance(x, tuple))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return copy

    def place(tree, specs):
        return jax.tree_util.tree_map_with_path(
            lambda path, x, spec: (jax.lax.with_sharding_constraint(x, spec)
                                   if in_copy(path_keys(path), mtp_heads) else x),
            tree, specs, is_leaf=lambda x: isinstance(x, P))

    # first the gather over `data` alone (the rules' layout), then the stage arrangement: one
    # step from sharded master weights to the stage layout would have XLA's partitioner
    # replicate each stack whole before slicing it
    copy = place(copy, param_specs(axes_tree, params, mesh, cfg))
    piped = _piped_segment(cfg, mesh)
    if piped is not None:
        plan = stage_plan(cfg, mesh.shape["pipeline"])
        layers = dict(copy["layers"])
        layers[piped] = stage_layout(layers[piped], plan)
        copy = {**copy, "layers": layers}
    return place(copy, compute_specs(axes_tree, params, mesh, cfg))
