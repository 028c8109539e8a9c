"""The memory plan's rows for the train step's copy of the params (train/parallel/compute_params.py)
and for the gradients, from abstract shapes: what `python -m train.plan` counts besides the
stored state.

Per device:
- compute copy: the copy the micro-batches compute with, made once per step: the weight
  matrices in model.compute_dtype under mixed precision, gathered over `data` (no ZeRO), the
  pipelined segment in its stage layout [S, V, k, ...] (k V repeat slots per device, padded
  ones included, instead of the stored R / S); the MTP heads the loss does not run are left
  out. None when the copy is the params themselves (no mixed precision, no pipeline).
- gradients: with a copy, its gradient (same dtypes and layout: the backward pass forms it)
  plus the float32 gradient sum in the stored params' layout (1/data of it per device with
  sharded master weights; a second one while accumulating over micro-batches, the pulled-back
  gradient of the current one); without, one (two when accumulating) param-shaped trees.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from model.parallel.mesh import spec_axes
from model.parallel.rules import abstract_mesh, path_keys
from train.config import RunConfig
from train.parallel.compute_params import (
    compute_params,
    compute_specs,
    in_copy,
    mixed_precision,
)


def makes_copy(run: RunConfig, sizes: dict[str, int]) -> bool:
    """Whether the step computes with a copy of the params rather than the params."""
    return sizes["pipeline"] > 1 or mixed_precision(run.model)


def _copy_bytes(copy: Any, specs: Any, sizes: dict[str, int], mtp_heads: int) -> int:
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
               // math.prod(sizes[a] for entry in spec for a in spec_axes(entry))
               for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(copy)[0],
                                          spec_leaves)
               if in_copy(path_keys(path), mtp_heads))


def compute_copy_bytes(run: RunConfig, sizes: dict[str, int], axes: Any, params: Any) -> int:
    """Per-device bytes of the compute copy of `params` (abstract, logical `axes`); 0 when the
    step computes with the params themselves."""
    if not makes_copy(run, sizes):
        return 0
    mesh, heads = abstract_mesh(sizes), run.trained_mtp_heads()
    with jax.sharding.use_abstract_mesh(mesh):
        copy = jax.eval_shape(lambda p: compute_params(p, axes, run.model, heads), params)
    return _copy_bytes(copy, compute_specs(axes, params, mesh, run.model), sizes, heads)


def gradient_bytes(run: RunConfig, sizes: dict[str, int], copy: int, stored_params: int,
                   accumulation: int) -> tuple[int, str]:
    """(per-device gradient bytes, how they were counted) given the compute copy's bytes
    `copy`, the stored params' `stored_params` (float32) and the accumulation steps."""
    sums = 2 if accumulation > 1 else 1
    if not copy:
        what = "sum + micro-batch" if sums > 1 else "like the params"
        return sums * stored_params, what
    what = "of the compute copy + float32 sum" + (" + micro-batch" if sums > 1 else "")
    return copy + sums * stored_params, what
