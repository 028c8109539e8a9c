"""Toggle's token budgets (Kimi K2.5, eq. 2): budget(x) is the rho-percentile of the lengths of
the correct ones among K responses of the initial policy to problem x, estimated once at the
start of training and then fixed.

    table = budget_table(workdir, resumed, run.rl, tasks, sample)   # estimated or read back
    table.of(drawn.tasks, drawn.problems)      # float64 [B] tokens, +inf: no budget
    rewards, metrics = toggled_rewards(drawn, table, run.rl, iteration)    # eq. 2 on a draw

Which problems, and when: every training problem of every task, at the start of a fresh run,
before its first iteration; the held-out problems are never trained on and get none. The
alternative, estimating a problem lazily at its first draw with the initial weights kept, costs
only the problems a run reaches, but needs a second copy of the weights when `rl.kl_coef` is 0
and a table that grows with every checkpoint. Estimating everything up front is eq. 2 as the
report states it ("once at the start"), and a problem's budget then never depends on which
iteration drew it first. Cost: K samples of every training problem, at the rollouts' speed
(docs/post_training.md, "Toggle", has the measurements).

Deterministic: problems in the tasks' order and each task's training order, `rows // K` problems
per batch, each repeated K times in adjacent rows (the last batch filled with repeats of its last
problem, whose extra results are dropped); batch b samples with key fold_in(key(seed), KEY_STREAM,
b), a stream the rollouts' keys fold_in(key(seed), iteration) never reach.

A problem with no correct sample gets no budget (None here, +inf in `of`): the source leaves it
open, and eq. 2's budget phase would otherwise need a length the policy never reached with a
right answer; such problems mostly have a group accuracy below lambda anyway.

|y| is `Rollouts.response_lengths` (the response's tokens, its stop token included), as in the
reward; "correct" is the task's rule verifier (`Draw.correct`), as in the indicator. Percentiles
interpolate linearly between order statistics (numpy's default). The table is written to the
workdir atomically once; a resumed run reads it instead of estimating again (its initial
weights may be gone), so it trains on the straight run's budgets.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np
from tqdm import tqdm

from model.interop.atomic_file import write_text_atomically
from rl.config import RLConfig
from rl.draw import Draw
from rl.objectives.toggle import phase, toggle_metrics, toggle_rewards, within_budget
from train.loop import TrainingError
from train.telemetry.progress import on_terminal

BUDGETS_FILE = "toggle_budgets.json"
KEY_STREAM = 2 ** 32 - 1  # the estimation's keys: fold_in(key(seed), KEY_STREAM, batch)


def percentile_budget(lengths, correct, percentile: float) -> float | None:
    """The `percentile` (0-100) of the lengths [K] of the samples that are `correct` (bool [K]);
    None when none is."""
    right = np.asarray(lengths, np.float64)[np.asarray(correct, bool)]
    return float(np.percentile(right, percentile)) if right.size else None


@dataclasses.dataclass(frozen=True)
class BudgetTable:
    budgets: dict[str, dict[str, float | None]]  # task name -> problem key -> tokens or None

    def of(self, tasks: Sequence[str], problems: Sequence) -> np.ndarray:
        """Each row's budget: its task [B] and problem [B] (with `.key`) -> float64 [B] tokens,
        +inf where the problem has none."""
        values = [self.budgets[task][problem.key] for task, problem in zip(tasks, problems)]
        return np.array([math.inf if v is None else v for v in values], np.float64)

    def save(self, path: Path, **settings) -> None:
        """Writes the table (and `settings`, for the reader) to `path` atomically."""
        write_text_atomically(path, json.dumps({**settings, "budgets": self.budgets}) + "\n")

    @classmethod
    def load(cls, path: Path) -> "BudgetTable":
        return cls(json.loads(Path(path).read_text())["budgets"])


def estimate_budgets(sample: Callable[[list, jax.Array], Draw], tasks: Sequence, *,
                     samples: int, rows: int, percentile: float, seed: int,
                     progress: bool = False) -> BudgetTable:
    """Every training problem's budget. `sample(rows, key)` -> the `Draw` of `rows` [(task,
    problem)], one response each from the initial policy; `samples` K per problem, `rows` per
    call (a multiple of K)."""
    key = jax.random.fold_in(jax.random.key(seed), KEY_STREAM)
    pairs = [(task, problem) for task in tasks for problem in task.train]
    per_batch = rows // samples
    budgets: dict[str, dict[str, float | None]] = {task.name: {} for task in tasks}
    starts = range(0, len(pairs), per_batch)
    # A bar on a terminal only, as a run's progress: a log file would fill with its redraws.
    for batch, start in enumerate(tqdm(starts, desc="toggle budgets", unit="batch",
                                       disable=not (progress and on_terminal()), leave=False)):
        chunk = pairs[start:start + per_batch]
        padded = chunk + [chunk[-1]] * (per_batch - len(chunk))
        drawn = sample([pair for pair in padded for _ in range(samples)],
                       jax.random.fold_in(key, batch))
        lengths = drawn.rollouts.response_lengths.reshape(per_batch, samples)
        correct = drawn.correct.reshape(per_batch, samples)
        for (task, problem), length, right in zip(chunk, lengths, correct):
            budgets[task.name][problem.key] = percentile_budget(length, right, percentile)
    return BudgetTable(budgets)


def budget_table(workdir: Path, resumed: bool, rl: RLConfig, tasks: Sequence,
                 sample: Callable[[list, jax.Array], Draw]) -> BudgetTable:
    """A resumed run's table, read back; a fresh run's, estimated with `sample` (the initial
    policy, as `estimate_budgets`) and saved, replacing any that a start which never reached a
    checkpoint left."""
    path = Path(workdir) / BUDGETS_FILE
    if resumed:
        if not path.is_file():
            raise TrainingError(f"cannot resume {workdir} with rl.toggle: {path} (the budgets "
                                "estimated at the start) is missing")
        return BudgetTable.load(path)
    started = time.perf_counter()
    table = estimate_budgets(sample, tasks, samples=rl.budget_samples, rows=rl.batch_size,
                             percentile=rl.toggle.percentile, seed=rl.seed, progress=rl.progress)
    table.save(path, percentile=rl.toggle.percentile, budget_samples=rl.budget_samples)
    values = [b for budgets in table.budgets.values() for b in budgets.values()]
    print(f"toggle: budgets of {len(values)} training problems from {rl.budget_samples} samples "
          f"each in {time.perf_counter() - started:.0f} s; {values.count(None)} without a correct "
          "sample have none", flush=True)  # a notice: printed whatever rl.progress says
    return table


def toggled_rewards(drawn: Draw, table: BudgetTable, rl: RLConfig, iteration: int
                    ) -> tuple[np.ndarray, dict[str, float]]:
    """Eq. 2 on a draw (groups of N = `rl.samples_per_prompt` adjacent rows) at 0-based
    `iteration` -> (its rewards r~, float32 [B]; Toggle's metrics)."""
    lengths = drawn.rollouts.response_lengths
    budgets = table.of(drawn.tasks, drawn.problems)
    kept = within_budget(drawn.correct, lengths, budgets, group_size=rl.samples_per_prompt,
                         threshold=rl.toggle.accuracy_threshold)
    now = phase(iteration, rl.toggle.period)
    return (toggle_rewards(drawn.rewards, kept, now),
            toggle_metrics(drawn.rewards, kept, lengths, budgets, now))
