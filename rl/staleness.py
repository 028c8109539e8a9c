"""Bounded-staleness rollouts (Step 3.5's fully asynchronous RL, report App. D.2.4; MiMo-V2-Flash's
data scheduler): with `rl.max_staleness` = k > 0, iteration i trains on a batch drawn by the
policy of iteration i - k, corrected by truncated importance sampling
(rl/objectives/truncated_is.py).

An asynchronous system generates while it trains, and its trainer takes rollouts up to k
policy versions old. On one host the two run in turn with the same math: iteration i first
draws the batch of iteration i + k with its current policy (before its update) and stores it,
then trains on the batch drawn for i, k updates ago; the first k batches are drawn by the
initial policy before iteration 0 (staleness 0..k-1). Each iteration's batch holds the
problems it holds without staleness (the draw is keyed by the batch's iteration); only the
policy that sampled them differs. k = 0 is the on-policy loop.

The k waiting batches live in the RL state (`StaleRLState.buffer`, rl/trainer.py; slot i mod k
holds the batch of iteration i), so a checkpoint keeps them and a resumed run trains on exactly
the batches the straight run would: per row the rollout arrays, the rewards, the verifier's
verdict, the task and the problem (indices), and per slot the iteration whose policy drew it.

Partial rollouts (an over-long trajectory continued by the next iteration's policy) are not
implemented: every batch is P groups of N complete responses, which group advantages,
dynamic sampling and the fixed [B, T] rows of the compiled steps rely on; truncated responses
are scored as they are (with a critic, eq. 3 bootstraps them).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from rl.draw import Draw
from rl.rollout import Rollouts

ROLLOUT_ARRAYS = ("tokens", "segment_ids", "mask", "infer_logp", "truncated", "routed_experts")


class RolloutBuffer:
    """The waiting batches of a run: `max_staleness` slots of a run of `iterations` iterations
    over `tasks` (`rl/tasks.py`), kept in the buffer arrays of `StaleRLState.buffer`."""

    def __init__(self, tasks, max_staleness: int, iterations: int):
        self.slots, self.iterations = max_staleness, iterations
        self.tasks = list(tasks)
        self.task_index = {task.name: n for n, task in enumerate(self.tasks)}
        self.problem_index = {task.name: {p.key: n for n, p in enumerate(task.train)}
                              for task in self.tasks} if max_staleness else {}

    @staticmethod
    def empty(slots: int, rows: int, length: int, routes: tuple | None) -> dict:
        """Zeroed arrays for `slots` batches of `rows` rows of `length` tokens; `routes` =
        (MoE layers, k) with Rollout Routing Replay, else None."""
        arrays = {
            "tokens": np.zeros((slots, rows, length), np.int32),
            "segment_ids": np.zeros((slots, rows, length), np.int32),
            "mask": np.zeros((slots, rows, length), np.float32),
            "infer_logp": np.zeros((slots, rows, length), np.float32),
            "truncated": np.zeros((slots, rows), bool),
            "rewards": np.zeros((slots, rows), np.float32),
            "correct": np.zeros((slots, rows), bool),
            "task": np.zeros((slots, rows), np.int32),
            "problem": np.zeros((slots, rows), np.int32),
            "drawn_at": np.zeros((slots,), np.int32),
        }
        if routes is not None:
            arrays["routed_experts"] = np.full((slots, rows, routes[0], length, routes[1]), -1,
                                               np.int32)
        return arrays

    def fill(self, buffer: dict, draw: Callable[[int], Draw]) -> dict:
        """The buffer of a fresh run: the batches of iterations 0 .. k-1, `draw(iteration)`
        by the initial policy."""
        for batch in range(min(self.slots, self.iterations)):
            buffer = self.store(buffer, batch, draw(batch), 0)
        return buffer

    def next(self, buffer: dict, iteration: int, draw: Callable[[int], tuple[Draw, dict]]
             ) -> tuple[dict, Draw, int, dict]:
        """The batch iteration `iteration` trains on -> (buffer, that batch, the iteration
        whose policy drew it, the metrics of this iteration's draw). `draw(j)` -> (the batch
        of iteration j by the current policy, its metrics): with k = 0 the batch of this
        iteration; else that of iteration + k (while the run lasts), stored in the slot this
        iteration's batch leaves."""
        k = self.slots
        drawn, metrics = draw(iteration + k) if iteration + k < self.iterations else (None, {})
        if not k:
            return buffer, drawn, iteration, metrics
        slot = iteration % k
        trained, drawn_at = self.load(buffer, slot)
        if drawn is not None:
            buffer = self.store(buffer, slot, drawn, iteration)
        return buffer, trained, drawn_at, metrics

    def store(self, buffer: dict, slot: int, drawn: Draw, drawn_at: int) -> dict:
        """A copy of `buffer` whose `slot` holds `drawn`, sampled by the policy of iteration
        `drawn_at`."""
        rollouts = drawn.rollouts
        entry = {name: getattr(rollouts, name) for name in ROLLOUT_ARRAYS if name in buffer}
        entry.update(
            rewards=drawn.rewards, correct=drawn.correct,
            task=np.array([self.task_index[t] for t in drawn.tasks], np.int32),
            problem=np.array([self.problem_index[t][p.key]
                              for t, p in zip(drawn.tasks, drawn.problems)], np.int32),
            drawn_at=np.int32(drawn_at))
        out = {name: np.array(values) for name, values in buffer.items()}
        for name, value in entry.items():
            out[name][slot] = value
        return out

    def load(self, buffer: dict, slot: int) -> tuple[Draw, int]:
        """The batch in `slot` -> (its `Draw`, the iteration whose policy drew it)."""
        arrays = {name: np.asarray(values[slot]) for name, values in buffer.items()}
        tasks = [self.tasks[n] for n in arrays["task"]]
        problems = [task.train[n] for task, n in zip(tasks, arrays["problem"])]
        rollouts = Rollouts(**{name: arrays.get(name) for name in ROLLOUT_ARRAYS},
                            responses=_responses(arrays))
        return (Draw(rollouts, arrays["rewards"], arrays["correct"],
                     np.array([task.name for task in tasks]), problems),
                int(arrays["drawn_at"]))


def _responses(arrays: dict) -> list[list[int]]:
    """Each row's response ids without its stop token (the last response token of a row that
    was not truncated), as `collect_rollouts` lists them."""
    out = []
    for tokens, mask, truncated in zip(arrays["tokens"], arrays["mask"], arrays["truncated"]):
        response = tokens[mask > 0].tolist()
        out.append(response if truncated else response[:-1])
    return out
