"""The off-policy machinery of RL without a model: truncated importance sampling against a
float64 loop, the bounded-staleness schedule and its buffer (rl/staleness.py), and the config
switches. Routing replay and staleness inside the loop (metrics, exact resume, the mesh):
tests/rl/test_rl_loop.py and test_rl_mesh.py; in the model: tests/model/test_routing_replay.py."""

import dataclasses

import numpy as np
import pytest
from test_rl_loop import small_run

from model.config import ConfigError
from rl.draw import Draw
from rl.objectives.truncated_is import tis_weights
from rl.rollout import Rollouts
from rl.routing_replay import replay_metrics
from rl.staleness import RolloutBuffer
from rl.tasks import build_tasks
from rl.trainer import RLTrainer
from train.loop import TrainingError


def test_tis_weights_match_a_float64_loop():
    rng = np.random.default_rng(0)
    old, infer = rng.normal(-1.0, 0.6, (2, 2, 6))
    mask = np.float32(rng.integers(0, 2, (2, 6)))
    weights, stats = tis_weights(np.float32(old), np.float32(infer), mask, cap=1.5)
    expected = np.zeros((2, 6))
    truncated = total = 0.0
    for b in range(2):
        for t in range(6):
            if mask[b, t]:
                ratio = np.exp(old[b, t] - infer[b, t])
                expected[b, t] = min(ratio, 1.5)
                truncated += ratio > 1.5
                total += 1
    np.testing.assert_allclose(np.asarray(weights), expected, rtol=1e-5)
    assert 0 < truncated < total  # both sides of the cap occur
    assert float(stats["tis/truncation_rate"]) == pytest.approx(truncated / total)
    assert float(stats["tis/mean_weight"]) == pytest.approx(expected.sum() / total, rel=1e-5)


def test_replay_metrics_count_the_recorded_tokens_of_real_rows():
    """Row 0: tokens 0-2 recorded, their learned-layer mismatch shares 0, 0.5, 1 (token 3, not
    recorded, is ignored whatever it says); row 1 has no response (a minibatch's padding row)."""
    mismatch = np.float32([[0.0, 0.5, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    routes = np.zeros((2, 3, 4, 2), np.int32)
    routes[0, :, 3] = -1
    mask = np.float32([[0, 1, 1, 0], [0, 0, 0, 0]])
    got = replay_metrics(mismatch, routes, mask)
    assert float(got["topk_mismatch"]) == pytest.approx(0.5)  # (0 + 0.5 + 1) / 3
    assert float(got["token_mismatch"]) == pytest.approx(2 / 3)


def fake_draw(tasks, iteration: int, rows: int = 4, length: int = 6) -> Draw:
    """A scored batch whose every array names `iteration` (responses of 2 tokens)."""
    tokens = np.full((rows, length), iteration + 1, np.int32)
    mask = np.zeros((rows, length), np.float32)
    mask[:, 2:4] = 1
    truncated = np.arange(rows) % 2 == 0
    routes = np.full((rows, 2, length, 3), iteration, np.int32)
    rollouts = Rollouts(tokens, np.ones_like(tokens), mask, mask * -iteration, truncated,
                        [[iteration + 1] * (2 if t else 1) for t in truncated], routes)
    problems = [tasks[0].train[iteration * rows + r] for r in range(rows)]
    return Draw(rollouts, np.float32(np.arange(rows) + iteration), np.arange(rows) % 3 == 0,
                np.array([tasks[0].name] * rows), problems)


def test_stale_batches_come_back_k_iterations_later_whole():
    """k = 2 over 5 iterations: the initial policy draws the batches of iterations 0 and 1;
    iteration i draws the one of i + 2 (none from iteration 3 on) and trains on the one drawn
    for it, every field intact."""
    tasks = build_tasks(small_run().task)
    batches = RolloutBuffer(tasks, max_staleness=2, iterations=5)
    buffer = batches.fill(RolloutBuffer.empty(2, 4, 6, (2, 3)), lambda j: fake_draw(tasks, j))
    draws = []

    def draw(j):
        draws.append(j)
        return fake_draw(tasks, j), {"rollout_seconds": 1.0}

    for i in range(5):
        buffer, trained, drawn_at, metrics = batches.next(buffer, i, draw)
        want = fake_draw(tasks, i)
        assert drawn_at == max(0, i - 2) and bool(metrics) == (i + 2 < 5)
        for name in ("tokens", "segment_ids", "mask", "infer_logp", "truncated",
                     "routed_experts"):
            np.testing.assert_array_equal(getattr(trained.rollouts, name),
                                          getattr(want.rollouts, name), err_msg=name)
        assert trained.rollouts.responses == want.rollouts.responses
        np.testing.assert_array_equal(trained.rewards, want.rewards)
        np.testing.assert_array_equal(trained.correct, want.correct)
        assert list(trained.tasks) == list(want.tasks) and trained.problems == want.problems
    assert draws == [2, 3, 4]
    on_policy = RolloutBuffer(tasks, max_staleness=0, iterations=5)
    _, trained, drawn_at, _ = on_policy.next({}, 3, draw)
    assert drawn_at == 3 and draws[-1] == 3 and trained.rollouts.tokens[0, 0] == 4


def test_off_policy_switches_are_checked_and_resolved(tmp_path):
    for override, field in ((dict(max_staleness=-1), "rl.max_staleness"),
                            (dict(tis_cap=0.0), "rl.tis_cap"), (dict(tis="yes"), "rl.tis"),
                            (dict(routing_replay=1), "rl.routing_replay")):
        with pytest.raises(ConfigError, match=field):
            small_run(**override)
    assert not small_run().rl.uses_tis and small_run(max_staleness=1).rl.uses_tis
    mopd = dataclasses.replace(small_run(max_staleness=1).rl, algorithm="mopd")
    assert not mopd.uses_tis  # its eq. 8 weight already is a truncated ratio to pi_infer
    kimi = dataclasses.replace(small_run(max_staleness=1).rl, algorithm="kimi_k25")
    assert not kimi.uses_tis  # its eq. 1 ratio already is to pi_infer
    assert small_run(tis=True).rl.uses_tis
    dense = small_run(routing_replay=True)
    dense = dense.with_model(dense.model.replace(num_dense_layers=dense.model.num_layers))
    with pytest.raises(TrainingError, match="rl.routing_replay: the policy has no MoE layers"):
        RLTrainer(dense, tmp_path / "dense")
