"""The memory plan's rows for the train step's copy of the params (train/parallel/compute_params.py)
and for the gradients, from abstract shapes: what `python -m train.plan` counts besides the
stored state.

Per device:
- compute copy: the copy the micro-batches compute with, made once per step: the weight
  matrices in model.compute_dtype under mixed precision, gathered over `data` (no ZeRO), the
  pipelined segment in its stage layout [S, V, k, ...] (k V repeat slots per device, padded
  ones included, instead of the stored R / S); the MTP heads the loss does not run are left
  out. Only the arrays that differ from the stored ones count: a param in the same dtype and
  layout is its own copy (no new buffer), and so is a segment whose stage layout is a reshape
  of the stored stack (contiguous stages). None when the copy is the params themselves.
- gradients: with a copy, its gradient (same dtypes and layout: the backward pass forms it)
  plus the float32 gradient sum in the stored params' layout (1/data of it per device with
  sharded master weights; a second one while accumulating over micro-batches, the pulled-back
  gradient of the current one); without, one (two when accumulating) param-shaped trees.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from model.parallel.mesh import spec_axes
from model.parallel.pipeline import stage_plan
from model.parallel.rules import abstract_mesh, path_keys
from train.config import RunConfig
from train.parallel.compute_params import (
    compute_params,
    compute_specs,
    in_copy,
    mixed_precision,
)
from train.parallel.sharding import sharded_bytes


def makes_copy(run: RunConfig, sizes: dict[str, int]) -> bool:
    """Whether the step computes with a copy of the params rather than the params."""
    return sizes["pipeline"] > 1 or mixed_precision(run.model)


def _sharded_axes(spec: P, ndim: int) -> tuple:
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(spec_axes(entry) for entry in entries)


def copy_shapes(run: RunConfig, stages: int, axes: Any, params: Any) -> Any:
    """Shapes and dtypes of the compute copy of `params` (abstract, logical `axes`) on `stages`
    pipeline stages; the mesh's other axes shard the copy but do not change them."""
    with jax.sharding.use_abstract_mesh(abstract_mesh({"pipeline": stages})):
        return jax.eval_shape(
            lambda p: compute_params(p, axes, run.model, run.trained_mtp_heads()), params)


def compute_copy_bytes(run: RunConfig, sizes: dict[str, int], axes: Any, copy: Any,
                       params: Any, stored_specs: Any) -> int:
    """Per-device bytes of `copy` (`copy_shapes` on sizes["pipeline"] stages), the compute copy
    of `params` (abstract, logical `axes`, stored with `stored_specs`), that are not the stored
    arrays themselves."""
    mesh, heads = abstract_mesh(sizes), run.trained_mtp_heads()
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    copy_specs = jax.tree.leaves(compute_specs(axes, params, mesh, run.model), is_leaf=is_spec)
    contiguous = sizes["pipeline"] == 1 or stage_plan(run.model, sizes["pipeline"]).contiguous
    total = 0
    for (path, x), spec, stored, stored_spec in zip(
            jax.tree_util.tree_flatten_with_path(copy)[0], copy_specs, jax.tree.leaves(params),
            jax.tree.leaves(stored_specs, is_leaf=is_spec)):
        if not in_copy(path_keys(path), heads):
            continue
        if x.shape != stored.shape:  # the pipelined segment: [R, ...] -> [S, V, k, ...]
            stored_axes = _sharded_axes(stored_spec, stored.ndim)[1:]
            copy_axes = _sharded_axes(spec, x.ndim)[3:]
            reshaped = contiguous  # contiguous stages: a reshape of the stored stack
        else:
            stored_axes, copy_axes = (_sharded_axes(s, x.ndim) for s in (stored_spec, spec))
            reshaped = True
        if x.dtype == stored.dtype and reshaped and copy_axes == stored_axes:
            continue  # the stored array itself
        total += sharded_bytes(x.shape, x.dtype, spec, sizes)
    return total


def gradient_bytes(copy: int, stored_params: int, accumulation: int) -> tuple[int, str]:
    """(per-device gradient bytes, how they were counted) given the compute copy's bytes
    `copy`, the stored params' `stored_params` (float32) and the accumulation steps."""
    sums = 2 if accumulation > 1 else 1
    if not copy:
        what = "sum + micro-batch" if sums > 1 else "like the params"
        return sums * stored_params, what
    what = "of the compute copy + float32 sum" + (" + micro-batch" if sums > 1 else "")
    return copy + sums * stored_params, what
