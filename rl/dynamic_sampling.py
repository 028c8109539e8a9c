"""DAPO's dynamic sampling (Yu et al. 2025, 3.2): keep drawing groups until the batch holds P
groups whose rewards are not all equal.

A group whose N rewards are equal (all right or all wrong) has group advantages of exactly 0:
it adds no policy gradient, only tokens to the denominators, so the effective batch shrinks as
accuracy moves towards 0 or 1. `sample_batch` calls `draw(0), draw(1), ...` (each P groups,
deterministic per draw), keeps the groups whose training rewards differ in the order drawn and
stops as soon as P are kept; the surplus of the last draw is discarded.

At most `max_draws` draws (`rl.max_draws`). If they yield fewer than P varied groups, the batch
is filled with the equal-reward groups drawn first: the batch keeps its size (no recompilation
of the update step) and those groups train exactly as without dynamic sampling (zero group
advantage, tokens in the denominator); `sampling/batch_varied_frac` < 1 reports it.

The check runs on the rewards the advantages are computed from: the verifier's plus DAPO's
overlong penalty (`rl.objectives.overlong`), applied per draw before the check, so a group of
right answers whose lengths draw different penalties counts as varied (its advantages are not
0). The rows of a group stay adjacent, as `rl.objectives.losses.group_advantages` expects.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from rl.rollout import Rollouts


def varied_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """bool [groups]: whether each group's rewards are not all equal. rewards [groups * N]."""
    groups = np.asarray(rewards).reshape(-1, group_size)
    return groups.max(axis=1) > groups.min(axis=1)


def sample_batch(draw: Callable[[int], tuple[Rollouts, np.ndarray]],
                 shape: Callable[[Rollouts, np.ndarray], np.ndarray], *, groups: int,
                 group_size: int, dynamic: bool, max_draws: int
                 ) -> tuple[Rollouts, np.ndarray, np.ndarray, dict[str, float]]:
    """One iteration's batch of `groups` groups of `group_size` rows.

    `draw(d)` -> (rollouts, verifier rewards [groups * N]) of draw d; `shape(rollouts, rewards)`
    -> the training rewards [groups * N] (the verifier's plus the overlong penalty).
    -> (rollouts, verifier rewards, training rewards, metrics); without `dynamic` draw 0 as it
    is and no metrics, else the varied groups first, then any filler, each in the order drawn."""
    rollouts, rewards = draw(0)
    drawn = [(rollouts, rewards, shape(rollouts, rewards))]
    if not dynamic:
        return (*drawn[0], {})
    varied = [varied_groups(drawn[0][2], group_size)]
    while sum(map(np.sum, varied)) < groups and len(drawn) < max_draws:
        rollouts, rewards = draw(len(drawn))
        drawn.append((rollouts, rewards, shape(rollouts, rewards)))
        varied.append(varied_groups(drawn[-1][2], group_size))
    varied = np.concatenate(varied)
    order = np.concatenate([np.flatnonzero(varied), np.flatnonzero(~varied)])[:groups]
    all_rollouts = concat_rollouts([d[0] for d in drawn])
    all_rewards, all_shaped = (np.concatenate([d[i] for d in drawn]) for i in (1, 2))
    rows = _rows(order, group_size)
    metrics = {
        "sampling/draws": float(len(drawn)),
        "sampling/groups_drawn": float(len(varied)),
        "sampling/varied_frac": float(varied.mean()),  # of the groups drawn
        "sampling/batch_varied_frac": float(varied[order].mean()),  # < 1: max_draws was hit
        "sampling/drawn_reward": float(all_rewards.mean()),  # verifier, every group drawn
        "sampling/tokens_drawn": float(all_rollouts.response_lengths.sum()),
    }
    return take_rows(all_rollouts, rows), all_rewards[rows], all_shaped[rows], metrics


def take_rows(rollouts: Rollouts, rows: np.ndarray) -> Rollouts:
    """The given rows, in the order given, of every per-row field of `rollouts`."""
    return Rollouts(**{f.name: _take(getattr(rollouts, f.name), rows)
                       for f in dataclasses.fields(Rollouts)})


def concat_rollouts(parts: list[Rollouts]) -> Rollouts:
    """Row-wise concatenation of rollouts with equal row lengths."""
    fields = {f.name: [getattr(p, f.name) for p in parts] for f in dataclasses.fields(Rollouts)}
    return Rollouts(**{name: ([row for part in values for row in part]
                              if isinstance(values[0], list) else np.concatenate(values))
                       for name, values in fields.items()})


def _rows(groups: np.ndarray, group_size: int) -> np.ndarray:
    return (np.asarray(groups, int)[:, None] * group_size + np.arange(group_size)).reshape(-1)


def _take(value, rows):
    return [value[i] for i in rows] if isinstance(value, list) else value[rows]
