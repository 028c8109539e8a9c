"""DAPO's batch-side techniques: overlong reward shaping (rl/objectives/overlong.py) against
hand-computed values at the boundaries, and dynamic sampling (rl/dynamic_sampling.py) on fake
draws whose rows carry their identity: the batch keeps its size, never keeps a group whose
answers are all right or all wrong while groups of mixed accuracy were drawn (DAPO eq. 11:
0 < #correct < G, whatever the shaped rewards), counts its draws, is deterministic, and fills up
with the first other groups when rl.max_draws is hit."""

import numpy as np
import pytest

from rl.draw import Draw
from rl.dynamic_sampling import sample_batch, varied_groups
from rl.objectives.overlong import overlong_penalty
from rl.rollout import Rollouts, concat_rollouts

# --------------------------------------------------------------------------------------------
# overlong reward shaping


def test_overlong_penalty_at_the_boundaries():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then (6 - |y|) / 4 down to -1 at 10,
    # -1 beyond.
    lengths = [0, 5, 6, 7, 8, 9, 10, 11, 30]
    expected = [0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    got = overlong_penalty(lengths, max_length=10, buffer=4)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-7)


def test_overlong_penalty_off_and_whole_budget_buffer():
    np.testing.assert_array_equal(overlong_penalty([0, 3, 10, 11], 10, 0), [0, 0, 0, 0])
    # L_cache = L_max: the ramp starts at 0 tokens
    np.testing.assert_allclose(overlong_penalty([0, 1, 2, 3, 4], 4, 4),
                               [0, -0.25, -0.5, -0.75, -1.0], atol=1e-7)


# --------------------------------------------------------------------------------------------
# dynamic sampling

P, N, T = 3, 2, 4  # groups per batch, samples per group, row length

# Rewards of draws 0, 1, 2, ...: one row per group; 1 is a right answer (the fake verifier).
DRAWS = [
    [[1, 1], [0, 1], [0, 0]],  # draw 0: group 1 of mixed accuracy
    [[0, 0], [0, 0], [1, 1]],  # draw 1: none
    [[1, 0], [0.5, 0], [1, 0]],  # draw 2: groups 0 and 2 (0.5: partial credit, not right)
    [[0, 1], [0, 1], [0, 1]],
]


def fake_draw(log):
    """draw(d) -> a Draw whose tokens[:, 0] = 100 d + row and whose response length is the
    row's index within its group plus one; rewards from DRAWS; every row carries its id in its
    task name and problem too."""
    def draw(d):
        log.append(d)
        rows = np.arange(P * N)
        tokens = np.zeros((P * N, T), np.int32)
        tokens[:, 0] = 100 * d + rows
        mask = (np.arange(T)[None, :] <= rows[:, None] % N).astype(np.float32)
        rollouts = Rollouts(tokens=tokens, segment_ids=np.ones_like(tokens), mask=mask,
                            infer_logp=-mask, truncated=np.zeros(P * N, bool),
                            responses=[[int(i)] for i in tokens[:, 0]])
        rewards = np.asarray(DRAWS[d], np.float32).reshape(-1)
        return Draw(rollouts, rewards, rewards == 1, np.array([f"t{i}" for i in tokens[:, 0]]),
                    [int(i) for i in tokens[:, 0]])
    return draw


def ids(drawn):
    """Each row's id, after checking that every per-row field of the draw agrees on it."""
    row_ids = drawn.rollouts.tokens[:, 0].tolist()
    assert [r[0] for r in drawn.rollouts.responses] == row_ids == drawn.problems
    assert drawn.tasks.tolist() == [f"t{i}" for i in row_ids]
    return row_ids


def test_varied_groups_have_some_but_not_all_answers_right():
    pairs = np.array([1, 1, 0, 1, 0, 0, 1, 0], bool)
    assert varied_groups(pairs, 2).tolist() == [False, True, False, True]
    triples = np.array([1, 1, 1, 0, 0, 0, 1, 0, 1, 0, 1, 0], bool)
    assert varied_groups(triples, 3).tolist() == [False, False, True, True]


def test_dynamic_sampling_fills_the_batch_with_varied_groups_and_counts_draws():
    log = []
    drawn, metrics = sample_batch(
        fake_draw(log), groups=P, group_size=N, dynamic=True, max_draws=8)
    rollouts, rewards = drawn.rollouts, drawn.rewards
    assert log == [0, 1, 2]  # stops as soon as P varied groups are in hand
    assert rollouts.tokens.shape == (P * N, T) and rewards.shape == (P * N,)
    # draw 0's group 1 (rows 2, 3), then draw 2's groups 0 and 2
    assert ids(drawn) == [2, 3, 200, 201, 204, 205]  # every field moved together
    assert rewards.tolist() == [0, 1, 1, 0, 1, 0]
    assert drawn.correct.tolist() == [False, True, True, False, True, False]
    assert varied_groups(drawn.correct, N).all()
    np.testing.assert_array_equal(rollouts.mask.sum(1), [1, 2, 1, 2, 1, 2])
    assert metrics == pytest.approx({
        "sampling/draws": 3.0, "sampling/groups_drawn": 9.0,
        "sampling/varied_frac": 3 / 9, "sampling/batch_varied_frac": 1.0,
        "sampling/drawn_reward": 7.5 / 18,  # the verifier's mean over the 18 rows drawn
        "sampling/tokens_drawn": 3 * P * (1 + 2),
    }, rel=1e-6)
    again = sample_batch(fake_draw([]), groups=P, group_size=N, dynamic=True, max_draws=8)
    assert ids(again[0]) == ids(drawn) and again[1] == metrics  # deterministic


def test_dynamic_sampling_at_the_draw_cap_fills_with_the_first_equal_groups():
    log = []
    drawn, metrics = sample_batch(
        fake_draw(log), groups=P, group_size=N, dynamic=True, max_draws=2)
    assert log == [0, 1]
    # one varied group (draw 0's group 1), then the equal groups in the order drawn
    assert ids(drawn) == [2, 3, 0, 1, 4, 5]
    assert drawn.rewards.tolist() == [0, 1, 1, 1, 0, 0]
    assert metrics["sampling/draws"] == 2 and metrics["sampling/groups_drawn"] == 6
    assert metrics["sampling/batch_varied_frac"] == pytest.approx(1 / 3)
    assert metrics["sampling/varied_frac"] == pytest.approx(1 / 6)


def test_dynamic_sampling_counts_right_answers_not_shaped_rewards():
    """With L_max = 2, L_cache = 1 each group's second row (2 tokens) gets -1, so draw 0's
    shaped rewards differ by length alone in group 0 (both right) and group 2 (both wrong: it
    would train on its lengths), and not in group 1 ([0, 1] - [0, 1]). Only group 1 has
    0 < #correct < G; the other place goes to the first other group drawn. The verifier's
    rewards come back unshaped; the batch's training rewards are shaped from them
    (`RLTrainer.training_rewards`)."""
    def shape(drawn):
        return drawn.rewards + overlong_penalty(drawn.rollouts.response_lengths, max_length=2,
                                                buffer=1)

    shaped_draw = shape(fake_draw([])(0)).reshape(-1, N)
    assert (shaped_draw.max(1) > shaped_draw.min(1)).tolist() == [True, False, True]
    drawn, metrics = sample_batch(fake_draw([]), groups=2, group_size=N, dynamic=True,
                                  max_draws=1)
    assert ids(drawn) == [2, 3, 0, 1] and metrics["sampling/batch_varied_frac"] == 0.5
    assert drawn.rewards.tolist() == [0, 1, 1, 1] and shape(drawn).tolist() == [0, 0, 1, 0]


def test_without_dynamic_sampling_one_draw_as_it_is():
    log = []
    drawn, metrics = sample_batch(fake_draw(log), groups=P, group_size=N, dynamic=False,
                                  max_draws=8)
    assert log == [0] and metrics == {}
    assert ids(drawn) == list(range(P * N))
    assert drawn.rewards.tolist() == np.float32(DRAWS[0]).reshape(-1).tolist()  # as drawn


def test_take_and_concat_rollouts_keep_rows_together():
    first = fake_draw([])(0).rollouts
    second = fake_draw([])(1).rollouts
    both = concat_rollouts([first, second])
    picked = both.take(np.array([7, 0]))
    assert picked.tokens[:, 0].tolist() == [101, 0] and picked.responses == [[101], [0]]
    np.testing.assert_array_equal(picked.mask, both.mask[[7, 0]])
