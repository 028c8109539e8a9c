"""One draw of an RL iteration: P problems x N samples of the task mix, sampled and scored.

    drawn = trainer.draw(state, iteration, draw=1)
    drawn.rollouts, drawn.rewards                            # [P * N] rows, their rewards
    drawn.tasks, drawn.correct, drawn.problems               # per row: task name, exact match

Each row carries its task's name, so per-domain work (per-task metrics, a teacher per domain in
on-policy distillation) can pick rows by task. A problem's N samples are adjacent rows and
belong to one task. `select_rows` keeps a subset of rows (e.g. the groups a filter keeps) with
everything that belongs to them.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rl.rollout import Rollouts, concat_rollouts
from rl.task_mix import task_metrics


@dataclasses.dataclass
class Draw:
    rollouts: Rollouts
    rewards: np.ndarray  # float32 [P * N]: each task's reward (its verifier or its judge)
    correct: np.ndarray  # bool [P * N]: the task's rule verifier accepts the response
    tasks: np.ndarray  # str [P * N]: the task of each row
    problems: list  # [P * N]: the problem of each row

    def metrics(self, names: Sequence[str]) -> dict[str, float]:
        """reward, accuracy, and reward/<task>, accuracy/<task>, response_length/<task> (tokens
        per response, the stop token included) for the tasks `names`."""
        return {"reward": float(self.rewards.mean()), "accuracy": float(self.correct.mean()),
                **task_metrics(names, self.tasks, {
                    "reward": self.rewards, "accuracy": self.correct,
                    "response_length": self.rollouts.response_lengths})}

    def select_rows(self, rows: np.ndarray) -> "Draw":
        """The draw restricted to `rows` (int indices [m] or bool [P * N]), rollouts included."""
        index = np.arange(len(self.rewards))[rows]
        return Draw(self.rollouts.take(index), self.rewards[index], self.correct[index],
                    self.tasks[index], [self.problems[i] for i in index])


def concat_draws(parts: Sequence[Draw]) -> Draw:
    """The rows of several draws, one after another."""
    return Draw(concat_rollouts([p.rollouts for p in parts]),
                *(np.concatenate([getattr(p, name) for p in parts])
                  for name in ("rewards", "correct", "tasks")),
                [problem for p in parts for problem in p.problems])


def score_draw(rollouts: Rollouts, rows: Sequence[tuple], texts: Sequence[str]) -> Draw:
    """rows [B] of (task, problem) and the decoded responses [B] -> the scored `Draw`. Each
    task's rows are scored in one call (a judge batches them)."""
    rewards = np.zeros(len(rows), np.float32)
    correct = np.zeros(len(rows), bool)
    tasks = np.array([task.name for task, _ in rows])
    for task in {id(task): task for task, _ in rows}.values():
        index = np.flatnonzero(tasks == task.name)
        problems = [rows[i][1] for i in index]
        responses = [texts[i] for i in index]
        rewards[index] = task.reward.score(problems, responses)
        correct[index] = task.verifier.score(problems, responses) == 1.0
    return Draw(rollouts, rewards, correct, tasks, [problem for _, problem in rows])
