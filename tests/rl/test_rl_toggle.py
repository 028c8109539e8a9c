"""Kimi K2.5's Toggle (rl/objectives/toggle.py, rl/budget.py, `rl.toggle`): the phase schedule,
eq. 2's indicator and reward, the budget percentile and its estimation, all against hand values
and float64 loops; config errors by field; and a resumed Toggle run against the straight one."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from test_rl_loop import small_run

import rl.tasks as rl_tasks
from rl.budget import BUDGETS_FILE, BudgetTable, budget_table, estimate_budgets, \
    percentile_budget, toggled_rewards
from rl.config import RLConfig, ToggleConfig, load_rl_config, rl_config_from_dict
from rl.draw import Draw
from rl.loop import run_rl
from rl.objectives.toggle import phase, toggle_metrics, toggle_rewards, within_budget
from rl.rollout import Rollouts
from train.loop import TrainingError
from train.telemetry.metrics import read_metrics
from train_helpers import REPO

# --------------------------------------------------------------------------------------------
# the schedule and eq. 2


def test_phases_alternate_every_period_iterations_budget_first():
    # floor(t / m) mod 2 by hand
    assert [phase(t, 3) for t in range(13)] == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0]
    assert [phase(t, 1) for t in range(5)] == [0, 1, 0, 1, 0]
    assert [phase(t, 10) for t in (0, 9, 10, 19, 20, 29, 30)] == [0, 0, 1, 1, 0, 0, 1]


# Three groups of N = 4 samples, lambda = 0.5:
#   group 0: accuracy 1/4 < lambda: the budget does not bind, every row kept;
#   group 1: accuracy 2/4 = lambda: the budget binds; |y| = budget is kept, |y| = budget + 1 not;
#   group 2: accuracy 4/4 but no budget (+inf): every row kept.
CORRECT = [1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1]
LENGTHS = [9, 9, 9, 9, 5, 6, 7, 5, 30, 1, 2, 3]
BUDGETS = [4.0] * 4 + [5.0] * 4 + [np.inf] * 4
KEPT = [1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1]
REWARDS = [1.0, 0, 0, 0, 1.0, 1.0, 0, 0, 1.0, 1.0, 1.0, 1.0]


def test_indicator_at_the_lambda_and_budget_boundaries():
    kept = within_budget(np.array(CORRECT, bool), LENGTHS, BUDGETS, group_size=4, threshold=0.5)
    assert kept.dtype == bool
    np.testing.assert_array_equal(kept, np.array(KEPT, bool))
    # lambda just above 2/4: group 1 is exempt too
    np.testing.assert_array_equal(
        within_budget(np.array(CORRECT, bool), LENGTHS, BUDGETS, group_size=4, threshold=0.51),
        np.ones(12, bool))
    # lambda = 0: the budget binds for every group, even one that never answers right
    np.testing.assert_array_equal(
        within_budget(np.zeros(4, bool), [3, 4, 5, 6], [4.5] * 4, group_size=4, threshold=0.0),
        [True, True, False, False])
    # a fractional budget (an interpolated percentile): |y| <= 4.5 keeps 4, not 5
    np.testing.assert_array_equal(
        within_budget(np.ones(2, bool), [4, 5], [4.5, 4.5], group_size=2, threshold=0.5),
        [True, False])


def test_reward_is_gated_in_phase_0_and_untouched_in_phase_1():
    kept = np.array(KEPT, bool)
    rewards = np.array(REWARDS) * 0.75  # a judge's reward: not 0/1
    phase0 = toggle_rewards(rewards, kept, 0)
    assert phase0.dtype == np.float32
    np.testing.assert_array_equal(phase0, [0.75, 0, 0, 0, 0.75, 0, 0, 0, 0.75, 0.75, 0.75, 0.75])
    np.testing.assert_array_equal(toggle_rewards(rewards, kept, 1), np.float32(rewards))


def test_metrics_by_hand():
    kept = np.array(KEPT, bool)
    m0 = toggle_metrics(REWARDS, kept, LENGTHS, BUDGETS, 0)
    # removed: row 5 (right, over budget, kept=0); row 6 is over budget but earned nothing
    assert m0["toggle/phase"] == 0.0
    assert m0["toggle/budget_zeroed_frac"] == pytest.approx(1 / 12)
    # over budget: rows 0-3 (9 > 4), 5, 6 (> 5); budgets: rows 0-7 of 12, mean (4*4 + 4*5) / 8
    assert m0["toggle/over_budget_frac"] == pytest.approx(6 / 12)
    assert m0["toggle/budget_frac"] == pytest.approx(8 / 12)
    assert m0["toggle/budget_mean"] == pytest.approx(4.5)
    m1 = toggle_metrics(REWARDS, kept, LENGTHS, BUDGETS, 1)
    assert m1["toggle/phase"] == 1.0 and m1["toggle/budget_zeroed_frac"] == 0.0
    assert m1["toggle/over_budget_frac"] == pytest.approx(6 / 12)
    assert np.isnan(toggle_metrics([1.0], [True], [3], [np.inf], 0)["toggle/budget_mean"])


# --------------------------------------------------------------------------------------------
# the budget: percentile and estimation


def linear_percentile(values, rho):
    """Reference: sorted values, rank rho / 100 * (n - 1), linear between its neighbours."""
    ordered = sorted(float(v) for v in values)
    rank = rho / 100.0 * (len(ordered) - 1)
    low = int(rank // 1)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


def test_percentile_of_the_correct_lengths_by_hand_and_by_a_loop():
    lengths, correct = [4, 7, 5, 9], [True, False, True, True]  # correct lengths 4, 5, 9
    for rho, expected in [(0, 4.0), (25, 4.5), (50, 5.0), (75, 7.0), (100, 9.0)]:
        assert percentile_budget(lengths, correct, rho) == expected, rho
    assert percentile_budget([6, 8], [False, False], 50) is None
    assert percentile_budget([6], [True], 30) == 6.0
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 12))
        values, right = rng.integers(1, 50, n), rng.random(n) < 0.6
        right[int(rng.integers(n))] = True
        rho = float(rng.uniform(0, 100))
        expected = linear_percentile(values[right], rho)
        assert percentile_budget(values, right, rho) == pytest.approx(expected, rel=1e-12)


@dataclasses.dataclass(frozen=True)
class FakeProblem:
    key: str


@dataclasses.dataclass(frozen=True)
class FakeTask:
    name: str
    train: list


def fake_sample(calls):
    """sample(rows, key) -> a Draw whose sample j (position among a problem's adjacent rows)
    of problem "p<i>" is i + j tokens long and right iff j is even; logs the rows and keys."""
    def sample(rows, key):
        calls.append(([p.key for _, p in rows], jax.random.key_data(key).tolist()))
        lengths, correct = [], []
        for r, (_, problem) in enumerate(rows):
            j = r - next(s for s in range(r + 1) if rows[s][1] == problem)
            lengths.append(int(problem.key[1:]) + j)
            correct.append(j % 2 == 0)
        mask = (np.arange(40)[None, :] < np.array(lengths)[:, None]).astype(np.float32)
        rollouts = Rollouts(mask.astype(np.int32), mask.astype(np.int32), mask, -mask,
                            np.zeros(len(rows), bool), [[] for _ in rows])
        correct = np.array(correct)
        return Draw(rollouts, correct.astype(np.float32), correct,
                    np.array([t.name for t, _ in rows]), [p for _, p in rows])
    return sample


def test_estimation_covers_every_training_problem_once_deterministically():
    tasks = [FakeTask("a", [FakeProblem(f"p{i}") for i in (10, 20, 30)]),
             FakeTask("b", [FakeProblem(f"p{i}") for i in (5, 7)])]
    calls = []
    table = estimate_budgets(fake_sample(calls), tasks, samples=3, rows=6, percentile=50, seed=1)
    # 5 problems, 2 per call of 6 rows: 3 calls, the last filled with a repeat of "p7"
    assert [keys for keys, _ in calls] == [["p10"] * 3 + ["p20"] * 3, ["p30"] * 3 + ["p5"] * 3,
                                           ["p7"] * 6]
    assert len({str(key) for _, key in calls}) == 3  # a key of its own per batch
    # samples j = 0, 1, 2 of problem i: lengths i, i+1, i+2, right for j = 0, 2: median i + 1
    assert table.budgets == {"a": {"p10": 11.0, "p20": 21.0, "p30": 31.0},
                             "b": {"p5": 6.0, "p7": 8.0}}
    again = []
    assert estimate_budgets(fake_sample(again), tasks, samples=3, rows=6, percentile=50,
                            seed=1) == table
    assert again == calls
    other_seed = []
    estimate_budgets(fake_sample(other_seed), tasks, samples=3, rows=6, percentile=50, seed=2)
    assert [key for _, key in other_seed] != [key for _, key in calls]


def test_table_lookup_save_load_and_a_resume_without_it(tmp_path):
    table = BudgetTable({"a": {"p1": 3.5, "p2": None}, "b": {"p1": 7.0}})
    problems = [FakeProblem("p1"), FakeProblem("p2"), FakeProblem("p1")]
    np.testing.assert_array_equal(table.of(["a", "a", "b"], problems), [3.5, np.inf, 7.0])
    table.save(tmp_path / BUDGETS_FILE, percentile=50.0)
    assert json.loads((tmp_path / BUDGETS_FILE).read_text())["percentile"] == 50.0
    assert BudgetTable.load(tmp_path / BUDGETS_FILE) == table
    assert [p.name for p in tmp_path.iterdir()] == [BUDGETS_FILE]  # no temporary left behind
    with pytest.raises(TrainingError, match="toggle_budgets.json .* is missing"):
        budget_table(tmp_path / "elsewhere", True, RLConfig(), [], fake_sample([]))


def test_toggled_rewards_of_a_draw_in_both_phases():
    rows = len(REWARDS)
    mask = (np.arange(40)[None, :] < np.array(LENGTHS)[:, None]).astype(np.float32)
    problems = [FakeProblem(f"q{g}") for g in range(3) for _ in range(4)]
    drawn = Draw(Rollouts(mask.astype(np.int32), mask.astype(np.int32), mask, -mask,
                          np.zeros(rows, bool), [[] for _ in range(rows)]),
                 np.float32(REWARDS), np.array(CORRECT, bool), np.array(["t"] * rows), problems)
    table = BudgetTable({"t": {"q0": 4.0, "q1": 5.0, "q2": None}})
    rl = RLConfig(samples_per_prompt=4, toggle=ToggleConfig(enabled=True, period=2,
                                                            accuracy_threshold=0.5))
    gated = np.float32(REWARDS) * np.array(KEPT)
    for iteration, expected in [(0, gated), (1, gated), (2, REWARDS), (3, REWARDS), (4, gated)]:
        rewards, metrics = toggled_rewards(drawn, table, rl, iteration)
        np.testing.assert_array_equal(rewards, expected)
        assert metrics["toggle/phase"] == [0, 0, 1, 1, 0][iteration]
        assert metrics["toggle/budget_zeroed_frac"] == [1 / 12, 1 / 12, 0, 0, 1 / 12][iteration]


# --------------------------------------------------------------------------------------------
# config


@pytest.mark.parametrize("make, message", [
    (lambda: ToggleConfig(period=0), "rl.toggle.period: must be an integer >= 1, got 0"),
    (lambda: ToggleConfig(enabled="yes"), "rl.toggle.enabled: must be true or false"),
    (lambda: ToggleConfig(accuracy_threshold=1.5),
     "rl.toggle.accuracy_threshold: must be a number in [0, 1], got 1.5"),
    (lambda: ToggleConfig(percentile=101), "rl.toggle.percentile: must be a number in [0, 100]"),
    (lambda: ToggleConfig(percentile=True), "rl.toggle.percentile: must be a number in [0, 100]"),
    (lambda: ToggleConfig(budget_samples=0), "rl.toggle.budget_samples: must be an integer >= 1"),
    (lambda: RLConfig(prompts_per_iteration=4, samples_per_prompt=4,
                      toggle=ToggleConfig(enabled=True, budget_samples=3)),
     "rl.toggle.budget_samples: 3 must divide the 16 rollouts per iteration"),
])
def test_bad_toggle_values_name_the_field(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value).startswith(message), str(info.value)


def test_toggle_loads_from_overrides_with_its_defaults():
    config = REPO / "configs" / "rl_arith.yaml"
    rl = load_rl_config(config).rl
    assert not rl.toggle.enabled and rl.budget_samples == rl.samples_per_prompt == 8
    rl = load_rl_config(config, ["rl.toggle.enabled=true", "rl.toggle.budget_samples=4"]).rl
    assert rl.toggle == ToggleConfig(enabled=True, period=10, accuracy_threshold=0.5,
                                     percentile=50.0, budget_samples=4)
    assert rl.budget_samples == 4
    with pytest.raises(ValueError, match="rl.toggle.period: must be an integer >= 1"):
        load_rl_config(config, ["rl.toggle.period=0"])
    with pytest.raises(ValueError, match="rl.toggle.window: unknown config field"):
        load_rl_config(config, ["rl.toggle.window=3"])


# --------------------------------------------------------------------------------------------
# the loop


def toggle_run():
    """Every response counts as right (verifier patched), so a problem's budget is its shortest
    of K = 2 initial samples (rho = 0) and binds at once (lambda = 0); both iterations are in
    the budget phase (m = 2)."""
    run = small_run(advantages="group", max_new_tokens=4, toggle={
        "enabled": True, "period": 2, "percentile": 0.0, "accuracy_threshold": 0.0})
    return rl_config_from_dict({**run.to_dict(), "task": {"max_operand": 3}})


@pytest.mark.slow
def test_a_resumed_toggle_run_matches_the_straight_run(tmp_path, monkeypatch):
    problems, _ = rl_tasks.KINDS["arithmetic"]
    monkeypatch.setitem(rl_tasks.KINDS, "arithmetic", (
        problems, lambda responses, answers: np.ones(len(responses), np.float32)))
    straight = run_rl(toggle_run(), tmp_path / "straight")
    table = json.loads((straight.workdir / BUDGETS_FILE).read_text())
    budgets = table["budgets"]["arithmetic"]
    assert table["percentile"] == 0.0 and table["budget_samples"] == 2
    assert len(budgets) == 31 and all(1 <= b <= 4 for b in budgets.values())  # 32 - 1 held out

    first = run_rl(toggle_run(), tmp_path / "resumed", stop_after=1)
    assert first.interrupted and first.last_iteration == 1
    second = run_rl(toggle_run(), tmp_path / "resumed")
    assert (second.first_iteration, second.last_iteration) == (1, 2)
    # estimated once, by the first invocation, and as the straight run did
    assert json.loads((second.workdir / BUDGETS_FILE).read_text()) == table

    records = read_metrics(straight.workdir / "metrics.jsonl")
    resumed = read_metrics(second.workdir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2]
    last = records[-1]
    # the resumed iteration is in the budget phase and the budget removed rewards there
    assert last["toggle/phase"] == 0 and last["toggle/budget_zeroed_frac"] > 0
    for key in ("reward", "response_length", "actor/loss", "advantage_rms", "eval/accuracy",
                "toggle/budget_zeroed_frac", "toggle/over_budget_frac", "toggle/budget_mean"):
        assert resumed[-1][key] == pytest.approx(last[key], rel=1e-5), key
