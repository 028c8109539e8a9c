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

from typing import Callable

import numpy as np

from rl.draw import Draw, concat_draws


def varied_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """bool [groups]: whether each group's rewards are not all equal. rewards [groups * N]."""
    groups = np.asarray(rewards).reshape(-1, group_size)
    return groups.max(axis=1) > groups.min(axis=1)


def sample_batch(draw: Callable[[int], Draw], shape: Callable[[Draw], np.ndarray], *,
                 groups: int, group_size: int, dynamic: bool, max_draws: int
                 ) -> tuple[Draw, np.ndarray, dict[str, float]]:
    """One iteration's batch of `groups` groups of `group_size` rows.

    `draw(d)` -> draw d (`rl.draw.Draw`: rollouts and the task rewards [groups * N]);
    `shape(draw)` -> its training rewards [groups * N] (the task rewards plus the overlong
    penalty). -> (the batch's draw, its training rewards, metrics); without `dynamic` draw 0 as
    it is and no metrics, else the varied groups first, then any filler, each in the order
    drawn."""
    drawn = [draw(0)]
    shaped = [shape(drawn[0])]
    if not dynamic:
        return drawn[0], shaped[0], {}
    varied = [varied_groups(shaped[0], group_size)]
    while sum(map(np.sum, varied)) < groups and len(drawn) < max_draws:
        drawn.append(draw(len(drawn)))
        shaped.append(shape(drawn[-1]))
        varied.append(varied_groups(shaped[-1], group_size))
    varied = np.concatenate(varied)
    order = np.concatenate([np.flatnonzero(varied), np.flatnonzero(~varied)])[:groups]
    everything = concat_draws(drawn)
    rows = (order[:, None] * group_size + np.arange(group_size)).reshape(-1)
    metrics = {
        "sampling/draws": float(len(drawn)),
        "sampling/groups_drawn": float(len(varied)),
        "sampling/varied_frac": float(varied.mean()),  # of the groups drawn
        "sampling/batch_varied_frac": float(varied[order].mean()),  # < 1: max_draws was hit
        "sampling/drawn_reward": float(everything.rewards.mean()),  # every group drawn
        "sampling/tokens_drawn": float(everything.rollouts.response_lengths.sum()),
    }
    return everything.select_rows(rows), np.concatenate(shaped)[rows], metrics
