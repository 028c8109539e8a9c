"""The pipeline part of `python -m train.plan`: how the pipelined segment splits over the stages
and what GPipe and the interleaved schedule cost side by side (model/parallel/pipeline.py).

Per schedule (V virtual stages per device, V = 1 GPipe): the bubble (S - 1) / (V M + S - 1)
(interleaved 1F1B's for V > 1), the activation estimate of `activation_plan.activation_bytes`
(the schedule runs as JAX's autodiff of its forward ticks: every tick's saved activations stay
until the backward, GPipe-like, not 1F1B's; with model.pipeline_stage_remat only its stage
input), and the step's compute copy of the params with the gradients (train/parallel/
copy_plan.py: the copy holds the segment's k V repeat slots per device in the stage layout).
The candidates are GPipe, the configured V, and the largest V that keeps the repeat slots per
device of GPipe (ceil(R / (S V)) * V = ceil(R / S)), which lowers the bubble at no cost in work
per device.
"""

from __future__ import annotations

import dataclasses

from model.layers.layer_plan import layer_kinds, plan_segments
from model.parallel.pipeline import StagePlan, pipelined_segment, stage_plan
from train.config import RunConfig


def with_virtual(run: RunConfig, virtual: int) -> RunConfig:
    return dataclasses.replace(run, model=run.model.replace(pipeline_virtual_stages=virtual))


def free_virtual_stages(plan: StagePlan) -> int:
    """The largest V with GPipe's repeat slots per device (1 when M < S: V > 1 needs M >= S)."""
    gpipe = -(-plan.repeats // plan.stages)
    best = 1
    if plan.microbatches < plan.stages:
        return best
    for virtual in range(2, plan.repeats + 1):
        if -(-plan.repeats // (plan.stages * virtual)) * virtual == gpipe:
            best = virtual
    return best


def describe(run: RunConfig, stages: int) -> dict:
    """Static facts of the configured split (ValueError if training would refuse it)."""
    index = pipelined_segment(run.model, stages)
    segment = plan_segments(layer_kinds(run.model))[index]
    plan = stage_plan(run.model, stages)
    return {"stages": stages, "virtual_stages": plan.virtual, "segment": index,
            "segment_period": segment.period, "segment_repeats": segment.repeats,
            "chunk_repeats": list(plan.chunk_repeats), "slots_per_chunk": plan.slots,
            "idle_slots": plan.idle_slots,
            "layers_per_stage": segment.period * plan.slots * plan.virtual,
            "microbatches": plan.microbatches, "bubble_fraction": plan.bubble,
            "schedule": "GPipe" if plan.virtual == 1 else "interleaved"}


def schedules(run: RunConfig, sizes: dict[str, int], device_rows) -> list[dict]:
    """GPipe, the configured and the free interleaved schedule: bubble, activations and the
    per-device total, from `device_rows(variant)` (memory_plan.device_rows of a variant)."""
    plan = stage_plan(run.model, sizes["pipeline"])
    rows = []
    for virtual in sorted({1, plan.virtual, free_virtual_stages(plan)}):
        variant = with_virtual(run, virtual)
        option = stage_plan(variant.model, sizes["pipeline"])
        per_device = device_rows(variant)["per_device"]
        rows.append({"schedule": "GPipe" if virtual == 1 else "interleaved",
                     "virtual_stages": virtual, "slots_per_device": option.slots * virtual,
                     "bubble_fraction": option.bubble, "activations": per_device["activations"],
                     "total": sum(per_device.values()), "configured": virtual == plan.virtual})
    return rows
