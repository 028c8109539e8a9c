"""Learning-rate schedules (report 3.1): linear warm-up from 0, then cosine / constant / stages.

    schedule = learning_rate_schedule(lr=3e-3, warmup_steps=50, schedule="cosine",
                                      total_steps=1000, min_lr=3e-4)  # step -> lr

Report 3.1 pre-training, as `stages`: warm-up to 2.5e-4 over 2k steps, cosine to 5e-5 (stage 1),
cosine to 2e-5 (stage 2, 4k), then constant 2e-5 (32k annealing):
    lr=2.5e-4 warmup_steps=2000 lr_stages=[[n1, 5e-5, cosine], [n2, 2e-5, cosine], [n3, 2e-5, constant]]
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import jax.numpy as jnp
import optax


def _cosine(start: float, end: float, steps: int) -> optax.Schedule:
    """Half-cosine from `start` (count 0) to `end` (count >= steps); any start/end order."""
    def schedule(count):
        t = jnp.clip(count / steps, 0.0, 1.0)
        return end + (start - end) * 0.5 * (1.0 + jnp.cos(math.pi * t))
    return schedule


def _stage(start: float, end: float, steps: int, shape: str) -> optax.Schedule:
    if shape == "cosine":
        return _cosine(start, end, steps)
    if shape == "linear":
        return optax.linear_schedule(start, end, steps)
    if shape == "constant":  # holds the stage's start value; `end` takes over afterwards
        return optax.constant_schedule(start)
    raise ValueError(f"stages: unknown shape {shape!r}; expected cosine|linear|constant")


def _after_warmup(lr: float, schedule: str, decay_steps: int, min_lr: float,
                  stages: Sequence[tuple[int, float, str]]
                  ) -> tuple[list[optax.Schedule], list[int]]:
    """Schedules after warm-up with their lengths (the last one is unbounded: length 0)."""
    if schedule == "constant":
        return [optax.constant_schedule(lr)], [0]
    if schedule == "cosine":
        return [_cosine(lr, min_lr, max(1, decay_steps))], [0]
    if schedule == "stages":
        schedules, lengths, start = [], [], lr
        for steps, end, shape in stages:
            schedules.append(_stage(start, end, steps, shape))
            lengths.append(steps)
            start = end
        return schedules + [optax.constant_schedule(start)], lengths + [0]
    raise ValueError(f"schedule: unknown schedule {schedule!r}; expected constant|cosine|stages")


def learning_rate_schedule(*, lr: float, warmup_steps: int, schedule: str = "constant",
                           total_steps: int = 0, min_lr: float = 0.0,
                           stages: Sequence[tuple[int, float, str]] = (),
                           offset: int = 0) -> optax.Schedule:
    """Step -> learning rate: 0 at step 0, `lr` at `warmup_steps` (linear), then `schedule`:
    `constant` holds `lr`; `cosine` reaches `min_lr` at `total_steps` and stays there;
    `stages` ((steps, end_lr, shape), ...) chain from `lr` through each stage's end_lr and hold
    the last one. `offset`: the schedule's steps before this one's step 0 (a recipe stage's
    slice of one schedule: its step s is the schedule's step offset + s)."""
    schedules, lengths = _after_warmup(lr, schedule, total_steps - warmup_steps, min_lr, stages)
    if warmup_steps > 0:
        schedules = [optax.linear_schedule(0.0, lr, warmup_steps)] + schedules
        lengths = [warmup_steps] + lengths
    whole = (schedules[0] if len(schedules) == 1 else
             optax.join_schedules(schedules, list(itertools.accumulate(lengths[:-1]))))
    return (lambda count: whole(count + offset)) if offset else whole


def decay_start(*, lr: float, warmup_steps: int, schedule: str = "constant",
                min_lr: float = 0.0, stages: Sequence[tuple[int, float, str]] = (), **_
                ) -> int | None:
    """The step where `learning_rate_schedule`'s decay begins (takes its keyword arguments; a
    step of the whole schedule, before any `offset`):
    cosine, right after warm-up; stages, where the first stage that ends below its start begins
    (a constant one at its end, where its lower end_lr takes over). None where the rate never
    decays. DeepSeek-V4 and MiMo switch the MTP loss weight there (DeepSeek-V4 report 4.2.2:
    0.3, then 0.1 from the start of the decay)."""
    if schedule == "cosine":
        return warmup_steps if min_lr < lr else None
    step, start = warmup_steps, lr
    for steps, end, shape in stages if schedule == "stages" else ():
        if end < start:
            return step + steps if shape == "constant" else step
        step, start = step + steps, end
    return None
