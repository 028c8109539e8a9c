"""GPipe pipeline parallelism over the mesh axis `pipeline` (report 3.2 trains with 8 stages).

The longest scanned layer segment whose repeat count the stage count divides is split into
`stages` contiguous groups of repeats, one per device along `pipeline` (its params' `layers`
axis is sharded there, train/parallel/sharding.py). The batch is cut into M micro-batches; at clock
tick t stage s runs micro-batch t - s, so M + S - 1 ticks finish all of them and the idle share of
the stages, the bubble, is (S - 1) / (M + S - 1).

Written in the global (GSPMD) view, as MaxText does: a [S, ...] activation buffer sharded over
`pipeline` is advanced by one stage per tick (a collective permute) and every stage runs at once
through `jax.vmap(..., spmd_axis_name="pipeline")`, so shard_map regions inside a stage (expert
parallelism) keep working. Autodiff of the tick loop gives the mirrored backward schedule. The
layers before and after the segment, embeddings and heads run outside the pipeline, replicated
over `pipeline`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from model.layers.layer_plan import layer_kinds, plan_segments
from model.parallel.mesh import logical_spec


def pipelined_segment(cfg: ModelConfig, stages: int) -> int:
    """Index of the segment (`model.layers.layer_plan`) the pipeline runs: the one covering the most
    layers among those whose repeat count `stages` divides."""
    if not cfg.scan_layers:
        raise ValueError("mesh.pipeline > 1 needs model.scan_layers=true (stages split a "
                         "scanned layer segment)")
    segments = plan_segments(layer_kinds(cfg))
    fits = [i for i, seg in enumerate(segments) if seg.repeats % stages == 0]
    if not fits:
        shown = ", ".join(f"{seg.period} layers x {seg.repeats}" for seg in segments)
        raise ValueError(f"mesh.pipeline={stages}: no scanned layer segment repeats a multiple of "
                         f"{stages} times (segments: {shown}); change model.layout or mesh.pipeline")
    return max(fits, key=lambda i: segments[i].period * segments[i].repeats)


def num_microbatches(cfg: ModelConfig, stages: int) -> int:
    return cfg.pipeline_microbatches or 2 * stages


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Share of stage-ticks spent idle in a GPipe schedule."""
    return (stages - 1) / (microbatches + stages - 1)


# Per-layer MoE aux of a micro-batch -> whole batch: counts add, peaks take the maximum,
# per-token values concatenate (axis 1 of [layers, micro-batch rows, T]), means average.
_MERGE = {"expert_tokens": "sum", "expert_out_norm_max": "max", "routing_confidence": "rows",
          "routed_experts": "rows"}


def merge_microbatch_aux(name: str, values: jax.Array) -> jax.Array:
    """values: [M, R, ...] aux of M equal micro-batches -> [R, ...] for the whole batch."""
    how = _MERGE.get(name, "mean")
    if how == "sum":
        return jnp.sum(values, axis=0)
    if how == "max":
        return jnp.max(values, axis=0)
    if how == "rows":
        m, r, rows = values.shape[:3]
        return jnp.moveaxis(values, 0, 1).reshape(r, m * rows, *values.shape[3:])
    return jnp.mean(values, axis=0)


def pipeline_forward(repeat_fn: Callable, variables: dict, x: jax.Array, positions: jax.Array,
                     segment_ids: jax.Array | None, stages: int, microbatches: int):
    """Runs the R stacked repeats of a segment as `stages` pipeline stages.

    repeat_fn(variables_of_one_repeat, x [b, T, D], positions [b, T], segment_ids [b, T] | None)
      -> (x, aux pytree); variables: pytree with leading [R] axes; x: [B, T, D].
    Returns (x [B, T, D], aux with leading [R] axes merged over micro-batches).
    """
    repeats = jax.tree.leaves(variables)[0].shape[0]
    batch, length, width = x.shape
    if repeats % stages or batch % microbatches:
        raise ValueError(f"pipeline: {repeats} repeats / {stages} stages or batch {batch} / "
                         f"{microbatches} micro-batches does not divide")
    per_stage, rows = repeats // stages, batch // microbatches
    stage_vars = jax.tree.map(lambda a: a.reshape(stages, per_stage, *a.shape[1:]), variables)
    split = lambda a: a.reshape(microbatches, rows, *a.shape[1:])  # noqa: E731
    activation = logical_spec("batch", "length", "act_embed")
    buffer_spec = P("pipeline", *activation)  # [S, rows, T, D]: one slot per stage
    queue_spec = P(None, *activation)  # [M, rows, T, D]: micro-batches in and out
    xs = jax.lax.with_sharding_constraint(split(x), queue_spec)
    pos = split(positions)
    seg = None if segment_ids is None else split(segment_ids)

    def stage_fn(vars_s, h, pos_s, seg_s):
        def body(carry, repeat_vars):
            return repeat_fn(repeat_vars, carry, pos_s, seg_s)
        return jax.lax.scan(body, h, vars_s)

    run_stages = jax.vmap(stage_fn, in_axes=(0, 0, 0, None if seg is None else 0),
                          spmd_axis_name="pipeline")
    stage_ids = jnp.arange(stages)

    def tick(carry, t):
        buffer, outputs, aux_acc = carry
        # Stage 0 takes micro-batch t; stage s takes what stage s - 1 produced last tick.
        fresh = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, microbatches - 1), keepdims=True)
        buffer = jax.lax.with_sharding_constraint(
            jnp.concatenate([fresh, buffer[:-1]], axis=0), buffer_spec)
        micro = t - stage_ids  # micro-batch each stage works on this tick
        index = jnp.clip(micro, 0, microbatches - 1)
        valid = (micro >= 0) & (micro < microbatches)
        buffer, aux = run_stages(stage_vars, buffer, pos[index],
                                 None if seg is None else seg[index])
        done = t - (stages - 1)
        outputs = jax.lax.with_sharding_constraint(jax.lax.dynamic_update_index_in_dim(
            outputs, jnp.where(done >= 0, buffer[-1], outputs[jnp.maximum(done, 0)]),
            jnp.maximum(done, 0), 0), queue_spec)
        aux_acc = jax.tree.map(lambda acc, a: _store(acc, a, index, valid), aux_acc, aux)
        return (buffer, outputs, aux_acc), None

    probe = jnp.zeros((stages,), jnp.int32)
    aux_shapes = jax.eval_shape(run_stages, stage_vars, jnp.zeros((stages, *xs.shape[1:]), x.dtype),
                                pos[probe], None if seg is None else seg[probe])[1]
    aux_init = jax.tree.map(lambda s: jnp.zeros((microbatches, *s.shape), s.dtype), aux_shapes)
    buffer = jax.lax.with_sharding_constraint(jnp.zeros((stages, rows, length, width), x.dtype),
                                              buffer_spec)
    outputs = jax.lax.with_sharding_constraint(jnp.zeros_like(xs), queue_spec)
    (_, outputs, aux_acc), _ = jax.lax.scan(
        tick, (buffer, outputs, aux_init), jnp.arange(microbatches + stages - 1))

    def merge(path, a):  # [M, S, per_stage, ...] -> [R, ...] over the whole batch
        flat = a.reshape(microbatches, repeats, *a.shape[3:])
        return merge_microbatch_aux(str(getattr(path[-1], "key", "")), flat)

    return (outputs.reshape(batch, length, width),
            jax.tree_util.tree_map_with_path(merge, aux_acc))


def _store(acc: jax.Array, aux: jax.Array, index: jax.Array, valid: jax.Array) -> jax.Array:
    """acc [M, S, ...]; aux [S, ...]: stage s's value goes to micro-batch index[s] if valid."""
    for s in range(aux.shape[0]):
        current = acc[index[s], s]
        acc = acc.at[index[s], s].set(jnp.where(valid[s], aux[s], current))
    return acc
