"""Timing of the jitted train step, shared by benchmarks.train_step and benchmarks.gpu.suite.

Imports the step and nothing of the input pipeline (grain, tokenizers), so that the GPU suite
runs on an accelerator image that lacks them.
"""

import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from benchmarks.common import temp_bytes
from train.step import make_train_step


class TimedSteps(NamedTuple):
    state: Any  # the state after the last step
    metrics: dict  # of the last step
    compile_s: float
    losses: list[float]  # every step's loss, warm-up included
    step_seconds: list[float]  # wall time of each step after the warm-up
    temp_bytes: int | None  # XLA's planned scratch memory of the compiled step
    compiled: Any  # the compiled step: (state, batch, mask_meta) -> (state, metrics), donating


def timed_steps(training, run, state, next_batch: Callable[[], dict], *, warmup: int,
                steps: int) -> TimedSteps:
    """Compiles the jitted `train.step` once, runs `warmup` untimed steps then `steps` timed
    ones (each waits for its metrics), on batches from `next_batch()` ([num_micro, micro, T]
    arrays, see train/step.py)."""
    step_fn = jax.jit(make_train_step(training, run), donate_argnums=0)
    start = time.perf_counter()
    compiled = step_fn.lower(state, next_batch(), np.bool_(False)).compile()
    compile_s = time.perf_counter() - start
    losses, times, metrics = [], [], {}
    for index in range(warmup + steps):
        inputs = next_batch()
        start = time.perf_counter()
        state, metrics = compiled(state, inputs, np.bool_(False))
        jax.block_until_ready(metrics)
        if index >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(metrics["loss"]))
    return TimedSteps(state, metrics, compile_s, losses, times, temp_bytes(compiled), compiled)
