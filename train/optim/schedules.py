"""Learning-rate schedules (report 3.1): linear warm-up from 0, then cosine / constant / stages.

    schedule = learning_rate_schedule(cfg)   # optax.Schedule: step (int or int array) -> lr

Report 3.1 pre-training, as `stages`: warm-up to 2.5e-4 over 2k steps, cosine to 5e-5 (stage 1),
cosine to 2e-5 (stage 2, 4k), then constant 2e-5 (32k annealing):
    lr=2.5e-4 warmup_steps=2000 lr_stages=[[n1, 5e-5, cosine], [n2, 2e-5, cosine], [n3, 2e-5, constant]]
"""

from __future__ import annotations

import itertools
import math

import jax.numpy as jnp
import optax

from train.config import TrainConfig


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
    raise ValueError(f"train.lr_stages: unknown shape {shape!r}; expected cosine|linear|constant")


def _after_warmup(cfg: TrainConfig) -> tuple[list[optax.Schedule], list[int]]:
    """Schedules after warm-up with their lengths (the last one is unbounded: length 0)."""
    if cfg.schedule == "constant":
        return [optax.constant_schedule(cfg.lr)], [0]
    if cfg.schedule == "cosine":
        return [_cosine(cfg.lr, cfg.min_lr, max(1, cfg.steps - cfg.warmup_steps))], [0]
    if cfg.schedule == "stages":
        schedules, lengths, start = [], [], cfg.lr
        for steps, end, shape in cfg.lr_stages:
            schedules.append(_stage(start, end, steps, shape))
            lengths.append(steps)
            start = end
        return schedules + [optax.constant_schedule(start)], lengths + [0]
    raise ValueError(f"train.schedule: unknown schedule {cfg.schedule!r}")


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Step -> learning rate: 0 at step 0, `cfg.lr` at `cfg.warmup_steps` (linear), then
    `cfg.schedule` (cosine reaches `cfg.min_lr` at `cfg.steps` and stays there; stages chain
    from `cfg.lr` through each stage's end_lr and hold the last one)."""
    schedules, lengths = _after_warmup(cfg)
    if cfg.warmup_steps > 0:
        schedules = [optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)] + schedules
        lengths = [cfg.warmup_steps] + lengths
    if len(schedules) == 1:
        return schedules[0]
    boundaries = list(itertools.accumulate(lengths[:-1]))
    return optax.join_schedules(schedules, boundaries)
