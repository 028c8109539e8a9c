"""Kimi K2.5's Toggle (its tech report, eq. 2): token-efficient RL by alternating phases.

    r~(x, y) = r(x, y) * I{ (1/K) sum_i r(x, y_i) < lambda  or  |y| <= budget(x) }
                                           if floor(t / m) mod 2 = 0   (phase 0: budget-limited)
    r~(x, y) = r(x, y)                     if floor(t / m) mod 2 = 1   (phase 1: standard)

t is the 0-based iteration, m = `rl.toggle.period`, lambda = `rl.toggle.accuracy_threshold`.
In phase 0 a response longer than its problem's budget earns nothing, but only once the policy
solves the problem often enough (group accuracy >= lambda): quality is not traded for length
too early. Phase 1 lets responses grow to `rl.max_new_tokens` again, so the policy does not
overfit to the budget (the report's motivation for alternating).

Conventions here: the K of the indicator is the prompt's group of N = `rl.samples_per_prompt`
samples in the draw being scored, and r(x, y_i) there is the task's rule verifier (exact match,
`Draw.correct`), whatever reward the task trains on (a judge's reward is not 0/1); r(x, y) in
front is the task's reward. |y| counts the response's tokens as the loss does, its stop token
included (`Rollouts.response_lengths`). A problem without a budget (no correct sample when the
budget was estimated, rl/budget.py) has budget +inf: never limited. The budget's estimation is
rl/budget.py's; these are the pure schedule and reward.
"""

from __future__ import annotations

import numpy as np


def phase(iteration: int, period: int) -> int:
    """Toggle's phase of 0-based iteration t: floor(t / m) mod 2 (0: budget-limited)."""
    return (iteration // period) % 2


def within_budget(correct, lengths, budgets, *, group_size: int, threshold: float
                  ) -> np.ndarray:
    """Eq. 2's indicator per response: its group's accuracy is below lambda, or |y| <= budget.

    correct: bool [G * N] (groups of N adjacent rows), lengths: [G * N] tokens,
    budgets: [G * N] tokens (+inf: no budget) -> bool [G * N]."""
    accuracy = np.asarray(correct, np.float64).reshape(-1, group_size).mean(axis=1)
    exempt = np.repeat(accuracy < threshold, group_size)
    return exempt | (np.asarray(lengths, np.float64) <= np.asarray(budgets, np.float64))


def toggle_rewards(rewards, kept, phase_index: int) -> np.ndarray:
    """r~: rewards [B] times the indicator `kept` bool [B] in phase 0, as they are in phase 1
    -> float32 [B]."""
    rewards = np.asarray(rewards, np.float32)
    return np.where(kept, rewards, np.float32(0)) if phase_index == 0 else rewards


def toggle_metrics(rewards, kept, lengths, budgets, phase_index: int) -> dict[str, float]:
    """toggle/phase; toggle/budget_zeroed_frac: rows whose non-zero reward the budget removed
    (0 in phase 1); toggle/over_budget_frac: rows longer than their budget, in either phase
    and whatever the group's accuracy; toggle/budget_frac: rows whose problem has a budget;
    toggle/budget_mean: the mean budget of those rows (NaN if none). All arrays [B]."""
    lengths, budgets = np.asarray(lengths, np.float64), np.asarray(budgets, np.float64)
    removed = (np.asarray(rewards) != 0) & ~np.asarray(kept) if phase_index == 0 else \
        np.zeros(len(budgets), bool)
    known = np.isfinite(budgets)
    return {"toggle/phase": float(phase_index),
            "toggle/budget_zeroed_frac": float(removed.mean()),
            "toggle/over_budget_frac": float((lengths > budgets).mean()),
            "toggle/budget_frac": float(known.mean()),
            "toggle/budget_mean": float(budgets[known].mean()) if known.any() else float("nan")}
