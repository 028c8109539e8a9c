"""Anticipatory routing (train/anticipatory_routing.py; DeepSeek-V4 report 4.2.3): the spike rule,
which parameters route each step of a window, and a training run whose injected loss spike rolls
it back to a checkpoint and re-trains with routing from older parameters. The replayed routing
itself is checked in tests/model/test_moe_module.py and test_routing_replay.py."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from test_train import STEPS, loop_run

from model.interop.workdir import Checkpointer
from train.anticipatory_routing import EVENTS_FILE, RoutingHistory, SpikeDetector
from train.loop import Trainer, TrainingError, train
from train.telemetry.metrics import read_metrics


def test_a_spike_is_a_loss_far_above_the_median_of_a_full_window():
    detector = SpikeDetector(factor=1.5, window=3)
    assert not detector.is_spike(100.0)  # the window is not full yet
    for loss in (2.0, float("nan"), 2.2):  # non-finite losses are skipped steps: ignored
        assert not detector.is_spike(loss)
    assert detector.median() == 2.2  # of 100, 2.0, 2.2
    assert not detector.is_spike(3.2)  # 3.2 < 1.5 * 2.2
    assert detector.is_spike(3.4)  # > 1.5 * median(2.0, 2.2, 3.2) = 3.3, and not kept
    assert detector.median() == 2.2
    detector.reset()
    assert not detector.is_spike(50.0)


def test_each_step_of_a_window_routes_with_the_parameters_delta_steps_earlier():
    """Δt = 2 from the window's first step w: steps w and w + 1 route with θ_w (nothing older is
    kept), step t >= w + 2 with θ_{t-2}; the copies do not follow later changes of θ."""
    history = RoutingHistory(delta_steps=2)
    used = []
    for step in range(10, 15):
        params = {"w": jnp.full((2,), float(step))}
        used.append(float(history.routing_variables(params)["w"][0]))
        params["w"] = params["w"] + 100  # the update after the copy
    assert used == [10, 10, 10, 11, 12]
    history.clear()
    assert history.routing_variables({"w": jnp.zeros(1)})["w"][0] == 0


@pytest.mark.slow
def test_a_loss_spike_rolls_back_and_retrains_with_anticipatory_routing(tmp_path, monkeypatch):
    """Update 3's loss is multiplied by 10 the first time it runs: the loop sees the spike,
    rolls back to the checkpoint of step 2 (the one of step 4 holds the spiking update and is
    replaced), and re-trains steps 2..5 with routing from parameters two steps older (the first
    step of the window from its own: nothing replayed differs)."""
    original = Trainer.train_step

    def train_step(self):
        step_fn, spiked = original(self), []

        def step(state, batch, mask_meta):
            update = int(state.step)
            state, metrics = step_fn(state, batch, mask_meta)
            if update == 3 and not spiked:
                spiked.append(update)
                metrics = {**metrics, "loss": metrics["loss"] * 10}
            return state, metrics

        return step

    monkeypatch.setattr(Trainer, "train_step", train_step)
    run = loop_run("train.anticipatory_routing.enabled=true",
                   "train.anticipatory_routing.spike_window=3",
                   "train.anticipatory_routing.active_steps=1")
    summary = train(run, tmp_path)
    assert (summary.first_step, summary.last_step, len(summary.losses)) == (0, STEPS, STEPS)
    events = json.loads((tmp_path / EVENTS_FILE).read_text())["events"]
    assert [(e["spike_step"], e["rollback_to"], e["active_until"]) for e in events] == [(4, 2, 6)]
    assert events[0]["loss"] > 1.5 * events[0]["median"]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # rows 3.. rewritten once
    active = [r["anticipatory_routing/active"] for r in records]
    assert active == [0, 0, 1, 1, 1, 1]  # updates 2..5
    mismatch = [r.get("anticipatory_routing/mismatch") for r in records]
    assert mismatch[:2] == [None, None] and mismatch[2] == 0
    assert all(0 <= m <= 1 for m in mismatch[3:])
    assert records[3]["loss"] < 1.2 * records[2]["loss"]  # the re-run step 4 did not spike
    assert summary.losses == [r["loss"] for r in records]
    checkpoints = Checkpointer(tmp_path / "checkpoints", keep=100)
    assert checkpoints.all_steps() == [2, 4, 6]
    checkpoints.close()
    np.testing.assert_array_equal(np.isfinite(summary.losses), True)


def test_anticipatory_routing_needs_learned_routing(tmp_path):
    dense = loop_run("train.anticipatory_routing.enabled=true", "model.num_dense_layers=5")
    with pytest.raises(TrainingError, match="no MoE layer with learned routing"):
        train(dense, tmp_path)
