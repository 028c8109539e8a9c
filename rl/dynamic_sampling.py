"""DAPO's dynamic sampling (Yu et al. 2025, 3.2, eq. 11): keep drawing groups until the batch
holds P groups with 0 < #correct < G.

A group whose G responses are all right or all wrong teaches nothing about correctness: with
a rule reward its group advantages are exactly 0, so it adds no policy gradient, only tokens to
the denominators, and the effective batch shrinks as accuracy moves towards 0 or 1.
`sample_batch` calls `draw(0), draw(1), ...` (each P groups, deterministic per draw), keeps the
groups of mixed accuracy in the order drawn and stops as soon as P are kept; the surplus of the
last draw is discarded.

At most `max_draws` draws (`rl.max_draws`). If they yield fewer than P mixed groups, the batch
is filled with the other groups drawn first: the batch keeps its size (no recompilation of the
update step) and those groups train exactly as without dynamic sampling;
`sampling/batch_varied_frac` < 1 reports it.

The check counts correct answers (`Draw.correct`, the task's rule verifier), as DAPO's eq. 11
does, not the training rewards: DAPO's overlong penalty and Toggle's budget shape those (on the
batch once drawn, `RLTrainer.training_rewards`), and a group of all-wrong answers whose lengths
draw different penalties would otherwise be kept and trained on its lengths alone
(std-normalised advantages of order 1 from penalties of order 0.1). The rows of a group stay
adjacent, as `rl.objectives.losses.group_advantages` expects.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from rl.draw import Draw, concat_draws


def varied_groups(correct: np.ndarray, group_size: int) -> np.ndarray:
    """bool [groups]: whether each group has 0 < #correct < G (DAPO eq. 11). correct: bool
    [groups * G]."""
    right = np.asarray(correct, bool).reshape(-1, group_size).sum(axis=1)
    return (right > 0) & (right < group_size)


def sample_batch(draw: Callable[[int], Draw], *, groups: int, group_size: int, dynamic: bool,
                 max_draws: int) -> tuple[Draw, dict[str, float]]:
    """One iteration's batch of `groups` groups of `group_size` rows.

    `draw(d)` -> draw d (`rl.draw.Draw`: rollouts, the task rewards and the verifier's
    `correct` [groups * N]). -> (the batch's draw, metrics); without `dynamic` draw 0 as it is
    and no metrics, else the groups of mixed accuracy first, then any filler, each in the order
    drawn."""
    drawn = [draw(0)]
    if not dynamic:
        return drawn[0], {}
    varied = [varied_groups(drawn[0].correct, group_size)]
    while sum(map(np.sum, varied)) < groups and len(drawn) < max_draws:
        drawn.append(draw(len(drawn)))
        varied.append(varied_groups(drawn[-1].correct, group_size))
    varied = np.concatenate(varied)
    order = np.concatenate([np.flatnonzero(varied), np.flatnonzero(~varied)])[:groups]
    everything = concat_draws(drawn)
    rows = (order[:, None] * group_size + np.arange(group_size)).reshape(-1)
    metrics = {
        "sampling/draws": float(len(drawn)),
        "sampling/groups_drawn": float(len(varied)),
        "sampling/varied_frac": float(varied.mean()),  # of the groups drawn: mixed accuracy
        "sampling/batch_varied_frac": float(varied[order].mean()),  # < 1: max_draws was hit
        "sampling/drawn_reward": float(everything.rewards.mean()),  # every group drawn
        "sampling/tokens_drawn": float(everything.rollouts.response_lengths.sum()),
    }
    return everything.select_rows(rows), metrics
