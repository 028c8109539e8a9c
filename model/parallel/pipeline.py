"""Pipeline parallelism over the mesh axis `pipeline` (report 3.2 trains with 8 stages and virtual
stages): GPipe, and its interleaved form with V virtual stages per device; stages may be uneven.

The scanned layer segment covering the most layers among those with at least S repeats (S = the
`pipeline` size) is cut into C = S * V chunks of consecutive repeats. Chunk c runs on device
c mod S, so with V > 1 (`model.pipeline_virtual_stages`) each device holds V chunks spread over
the depth, and a micro-batch passes through every device V times (round v = chunk c // S). When
C does not divide the repeats R, chunk sizes differ by one (the first R mod C chunks get the
extra repeat; with C > R some are empty): every chunk is padded to k = ceil(R / C) slots, and a
padded slot passes its input through unchanged. The slowest stage sets the pace of a pipeline,
so running the padded slots costs no time beyond the unevenness itself.

Schedule. The batch is cut into M micro-batches (`model.pipeline_microbatches`, default 2 S); at
clock tick t device s works on item w = t - s (0 <= w < V M): micro-batch w mod M in round
w // M. Device 0 takes round 0 from the batch and later rounds from the last device's output of
the round before, which comes back M - S + 1 ticks later (V > 1 needs M >= S). A circular
buffer of M micro-batches holds those outputs and, after the last round, the result. V M + S - 1
ticks of k slots each finish the work, so the idle share of the devices, the bubble, is
(S - 1) / (V M + S - 1): GPipe's (S - 1) / (M + S - 1) at V = 1, and that of interleaved 1F1B
(Narayanan et al. 2021) for V > 1. This is the breadth-first order of that schedule: the
backward pass is JAX's autodiff of the tick loop (the mirrored schedule), so every tick's saved
activations stay live until it, as in GPipe, rather than 1F1B's at most ~S micro-batches in
flight. With `model.pipeline_stage_remat` (the default) a tick saves only its stage input (one
[b, T, ...] slice per device) and the backward recomputes the stage's forward before
differentiating it, one tick at a time: the saved activations grow with the ticks by one layer
input each, not by every layer's residuals, at the cost of one more forward of the segment.

Written in the global (GSPMD) view, as MaxText does: an [S, ...] activation buffer sharded over
`pipeline` advances one stage per tick (a collective permute) and every stage runs at once
through `jax.vmap(..., spmd_axis_name="pipeline")`, so shard_map regions inside a stage (expert
parallelism) keep working. The segment's params keep their [R, ...] stack and layer order in the
model's tree (checkpoints move between meshes) and are arranged into the stage layout
[S, V, k, ...] (`stage_layout`): a reshape when V = 1 and S divides R (the stack is then stored
sharded over `pipeline` along R), otherwise a gather with zero rows for the padded slots and
one all-to-all (the stack is then stored sharded over `pipeline` along another dimension, see
`model.parallel.rules.param_specs`), whose transpose brings the gradients back. The train step
arranges its copy of the params once per step (train/parallel/compute_params.py) and passes it
`staged`. Layers outside the segment, embeddings and heads run outside the pipeline with their
rows split over `pipeline` too (one more data-parallel axis there: `model.parallel.rules`); the
micro-batch queue gathers the rows of each micro-batch from the pipeline's devices, and inside
the stages no logical axis maps to `pipeline` (`stage_rules`). The activations entering the
pipeline may carry more axes than [B, T, D] (mHC's n streams [B, T, n, D]); per-row inputs
(positions, segment ids, token ids for hash routing) follow their micro-batch.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from model.layers.layer_plan import layer_kinds, plan_segments
from model.layers.moe import PER_TOKEN_AUX
from model.parallel.mesh import logical_spec


def pipelined_segment(cfg: ModelConfig, stages: int) -> int:
    """Index of the segment (`model.layers.layer_plan`) the pipeline runs: the one covering the most
    layers among those with at least `stages` repeats."""
    if not cfg.scan_layers:
        raise ValueError("mesh.pipeline > 1 needs model.scan_layers=true (stages split a "
                         "scanned layer segment)")
    segments = plan_segments(layer_kinds(cfg))
    fits = [i for i, seg in enumerate(segments) if seg.repeats >= stages]
    if not fits:
        shown = ", ".join(f"{seg.period} layers x {seg.repeats}" for seg in segments)
        raise ValueError(f"mesh.pipeline={stages}: no scanned layer segment repeats at least "
                         f"{stages} times (segments: {shown}); change model.layout or "
                         "mesh.pipeline")
    return max(fits, key=lambda i: segments[i].period * segments[i].repeats)


def num_microbatches(cfg: ModelConfig, stages: int) -> int:
    return cfg.pipeline_microbatches or 2 * stages


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """Share of device-ticks spent idle: (S - 1) / (V M + S - 1)."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


class StagePlan(NamedTuple):
    """How R repeats of the pipelined segment map to S devices x V virtual stages."""

    stages: int  # S
    virtual: int  # V
    repeats: int  # R
    microbatches: int  # M
    remat: bool = True  # a tick saves its stage input only (model.pipeline_stage_remat)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    @property
    def slots(self) -> int:
        """k: repeat slots per chunk (the largest chunk)."""
        return -(-self.repeats // self.chunks)

    @property
    def chunk_repeats(self) -> tuple[int, ...]:
        """Real repeats of chunk c = v * S + s (device s, round v)."""
        base, extra = divmod(self.repeats, self.chunks)
        return tuple(base + (c < extra) for c in range(self.chunks))

    @property
    def idle_slots(self) -> int:
        return self.chunks * self.slots - self.repeats

    @property
    def contiguous(self) -> bool:
        """Device s holds repeats [s R/S, (s + 1) R/S): the stored stack's layout."""
        return self.virtual == 1 and self.idle_slots == 0

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.stages, self.microbatches, self.virtual)

    def slot_repeats(self) -> np.ndarray:
        """[C, k] repeat index of each slot; padded slots point at row R (a zero row)."""
        index = np.full((self.chunks, self.slots), self.repeats, np.int32)
        start = 0
        for c, size in enumerate(self.chunk_repeats):
            index[c, :size] = np.arange(start, start + size)
            start += size
        return index


def stage_plan(cfg: ModelConfig, stages: int) -> StagePlan:
    """The stage plan of `cfg` on `stages` devices; ValueError naming the field when the virtual
    stages lack the micro-batches they need."""
    repeats = plan_segments(layer_kinds(cfg))[pipelined_segment(cfg, stages)].repeats
    plan = StagePlan(stages, cfg.pipeline_virtual_stages, repeats,
                     num_microbatches(cfg, stages), cfg.pipeline_stage_remat)
    if plan.virtual > 1 and plan.microbatches < stages:
        raise ValueError(f"model.pipeline_microbatches: {plan.microbatches} micro-batches are "
                         f"fewer than the {stages} stages; virtual stages "
                         f"(model.pipeline_virtual_stages={plan.virtual}) need at least as many")
    return plan


# Per-layer MoE aux of a micro-batch -> whole batch: counts add, peaks take the maximum,
# per-token values concatenate (axis 1 of [layers, micro-batch rows, T]), means average.
_MERGE = {"expert_tokens": "sum", "expert_out_norm_max": "max",
          **dict.fromkeys(PER_TOKEN_AUX, "rows")}


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


def stage_layout(variables, plan: StagePlan):
    """Variables with a leading [R] axis -> [S, V, k, ...] (device, round, slot).

    One gather in device-major order (padded slots read zeros), whose [S V k] rows split over
    `pipeline` as they come: no transpose of a sharded stack (XLA's partitioner would
    replicate it whole first), and the stored stack's `pipeline` sharding on another dimension
    becomes one all-to-all."""
    if plan.contiguous:
        return jax.tree.map(lambda a: a.reshape(plan.stages, 1, plan.slots, *a.shape[1:]),
                            variables)
    # [C, k] chunk-major (c = v S + s) -> [S, V, k] device-major
    index = plan.slot_repeats().reshape(plan.virtual, plan.stages, plan.slots)
    index = np.swapaxes(index, 0, 1).reshape(-1)

    def arrange(a):
        stacked = jnp.take(a, index, axis=0, mode="fill", fill_value=0)  # row R: zeros
        stacked = stacked.reshape(plan.stages, plan.virtual, plan.slots, *a.shape[1:])
        return jax.lax.with_sharding_constraint(
            stacked, P("pipeline", *[P.UNCONSTRAINED] * (stacked.ndim - 1)))

    return jax.tree.map(arrange, variables)


def _without_pipeline(axes):
    if axes is None or isinstance(axes, str):
        return None if axes == "pipeline" else axes
    kept = tuple(a for a in axes if a != "pipeline")
    return kept or None


def stage_rules() -> tuple:
    """The active logical-axis rules with `pipeline` taken out of every entry: inside the
    stages `pipeline` indexes the stages, never rows or weight dimensions."""
    return tuple((name, _without_pipeline(axes)) for name, axes in nn.get_logical_axis_rules())


def pipeline_forward(repeat_fn: Callable, variables: dict, x: jax.Array, rows: tuple,
                     plan: StagePlan, staged: tuple[str, ...] = ()):
    """Runs the R stacked repeats of a segment as pipeline stages (module docstring).

    repeat_fn(variables_of_one_repeat, x [b, T, ...], *rows of the micro-batch) -> (x, aux
    pytree); variables: pytree with leading [R] axes, or with `staged` naming some of its
    top-level entries (variable collections) that are already in the stage layout
    [S, V, k, ...]; x: [B, T, ...]; rows: per-row inputs [B, T] or None (positions, segment
    ids, token ids). Returns (x [B, T, ...], aux with leading [R] axes merged over
    micro-batches).
    """
    with nn.logical_axis_rules(stage_rules()):
        return _pipeline_forward(repeat_fn, variables, x, rows, plan, staged)


def _pipeline_forward(repeat_fn, variables, x, rows, plan, staged):
    stages, virtual, slots, microbatches = plan.stages, plan.virtual, plan.slots, plan.microbatches
    batch = x.shape[0]
    if batch % microbatches:
        raise ValueError(f"pipeline: batch {batch} does not split into {microbatches} "
                         "micro-batches")
    per_micro = batch // microbatches
    split = lambda a: a.reshape(microbatches, per_micro, *a.shape[1:])  # noqa: E731
    activation = (*logical_spec("batch", "length"), *[None] * (x.ndim - 2))
    buffer_spec = P("pipeline", *activation)  # [S, b, T, ...]: one slot per device
    queue_spec = P(None, *activation)  # [M, b, T, ...]: micro-batches in and out
    queue = jax.lax.with_sharding_constraint(split(x), queue_spec)
    row_inputs = tuple(None if r is None else split(r) for r in rows)
    stage_vars = {col: tree if col in staged else stage_layout(tree, plan)
                  for col, tree in variables.items()}
    live = jnp.asarray(plan.slot_repeats() < plan.repeats)  # [C, k]: real (not padded) slots

    def stage_fn(vars_s, stage, round_, h, *rows_s):
        chunk_vars = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, round_, 0, False),
                                  vars_s)
        chunk_live = live[round_ * stages + stage]

        def body(carry, slot):
            slot_vars, slot_live = slot
            out, aux = repeat_fn(slot_vars, carry, *rows_s)
            if plan.idle_slots:
                out = jnp.where(slot_live, out, carry)
            return out, aux

        return jax.lax.scan(body, h, (chunk_vars, chunk_live))

    row_axes = tuple(None if r is None else 0 for r in row_inputs)
    run_stages = jax.vmap(jax.checkpoint(stage_fn, prevent_cse=False) if plan.remat else stage_fn,
                          in_axes=(0, 0, 0, 0, *row_axes), spmd_axis_name="pipeline")
    stage_ids = jnp.arange(stages)
    work_items = virtual * microbatches

    def gather_rows(micro):
        return tuple(None if r is None else r[micro] for r in row_inputs)

    def tick(carry, t):
        buffer, queue, aux_acc = carry
        # Device 0 takes micro-batch t mod M (round 0: from the batch; later: the last device's
        # output of the previous round); device s takes what device s - 1 produced last tick.
        fresh = jax.lax.dynamic_index_in_dim(queue, t % microbatches, keepdims=True)
        buffer = jax.lax.with_sharding_constraint(
            jnp.concatenate([fresh, buffer[:-1]], axis=0), buffer_spec)
        work = t - stage_ids
        valid = (work >= 0) & (work < work_items)
        work = jnp.clip(work, 0, work_items - 1)
        micro, round_ = work % microbatches, work // microbatches
        buffer, aux = run_stages(stage_vars, stage_ids, round_, buffer, *gather_rows(micro))
        done = t - (stages - 1)
        slot = jnp.clip(done, 0, work_items - 1) % microbatches
        kept = jax.lax.dynamic_index_in_dim(queue, slot, keepdims=False)
        queue = jax.lax.with_sharding_constraint(jax.lax.dynamic_update_index_in_dim(
            queue, jnp.where(done >= 0, buffer[-1], kept), slot, 0), queue_spec)
        chunk = round_ * stages + stage_ids
        aux_acc = jax.tree.map(lambda acc, a: _store(acc, a, micro, chunk, valid), aux_acc, aux)
        return (buffer, queue, aux_acc), None

    probe = jnp.zeros((stages,), jnp.int32)
    aux_shapes = jax.eval_shape(run_stages, stage_vars, stage_ids, probe,
                                jnp.zeros((stages, *queue.shape[1:]), x.dtype),
                                *gather_rows(probe))[1]
    aux_init = jax.tree.map(
        lambda s: jnp.zeros((microbatches, plan.chunks, *s.shape[1:]), s.dtype), aux_shapes)
    buffer = jax.lax.with_sharding_constraint(jnp.zeros((stages, *queue.shape[1:]), x.dtype),
                                              buffer_spec)
    (_, queue, aux_acc), _ = jax.lax.scan(tick, (buffer, queue, aux_init),
                                          jnp.arange(work_items + stages - 1))

    where = np.argsort(plan.slot_repeats().reshape(-1), kind="stable")[:plan.repeats]

    def merge(path, a):  # [M, C, k, ...] -> [R, ...] over the whole batch
        flat = a.reshape(microbatches, plan.chunks * slots, *a.shape[3:])[:, where]
        return merge_microbatch_aux(str(getattr(path[-1], "key", "")), flat)

    return (queue.reshape(x.shape), jax.tree_util.tree_map_with_path(merge, aux_acc))


def _store(acc: jax.Array, aux: jax.Array, micro: jax.Array, chunk: jax.Array,
           valid: jax.Array) -> jax.Array:
    """acc [M, C, k, ...]; aux [S, k, ...]: device s's value goes to (micro[s], chunk[s])."""
    for s in range(aux.shape[0]):
        current = acc[micro[s], chunk[s]]
        acc = acc.at[micro[s], chunk[s]].set(jnp.where(valid[s], aux[s], current))
    return acc
