"""The weighted mix of tasks in every batch: how many prompts each task gets, which problems,
and the metrics per task.

    counts = allocate_prompts([0.5, 0.3, 0.2], 64)    # [32, 19, 13]
    rows = sample_mix(tasks, 64, rng)                  # [(task, problem)] task by task

The split is deterministic (the largest-remainder method), so every batch holds exactly the
same number of prompts per task and a task's share never drifts with the random draw.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from train.data.arithmetic import sample_problems


def allocate_prompts(weights: Sequence[float], total: int) -> list[int]:
    """`total` prompts split in proportion to `weights` by the largest-remainder (Hamilton)
    method: each task gets the floor of its quota total * w / sum(w), and the prompts left go
    one each to the largest fractional parts (ties: the earlier task). Sums to `total`."""
    quotas = [total * w / sum(weights) for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - quotas[i], i))
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    return counts


def sample_mix(tasks: Sequence, total: int, rng: np.random.Generator) -> list[tuple]:
    """`total` (task, problem) pairs, task by task in the tasks' order: each task's count
    (`allocate_prompts` of the tasks' weights) of distinct problems from its training split.
    One task draws exactly what `sample_problems(train, total, rng)` draws."""
    counts = allocate_prompts([t.weight for t in tasks], total)
    return [(task, problem) for task, count in zip(tasks, counts)
            for problem in sample_problems(task.train, count, rng)]


def task_metrics(names: Sequence[str], tasks: np.ndarray, values: dict[str, np.ndarray]
                 ) -> dict[str, float]:
    """{f"{metric}/{name}": mean of `values[metric]` over the rows of task `name`}, for every
    task with rows. tasks: str [n] (each row's task), values: metric -> [n]."""
    return {f"{metric}/{name}": float(np.mean(row_values[tasks == name]))
            for name in names if np.any(tasks == name)
            for metric, row_values in values.items()}
