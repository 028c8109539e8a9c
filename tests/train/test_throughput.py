"""Throughput and progress figures of the training loop come from completed steps: the logged
tokens/s of every row (the first ones after compiling and after a resume included) agree with
the wall time the steps took, MFU stays at most 1, and the progress display shows the main
head's loss (`loss/lm`) of the step it counts."""

from __future__ import annotations

import json
import time

import pytest
from train_helpers import small_run

from train.loop import Trainer, train
from train.telemetry.progress import Progress

STEPS, STOP = 6, 3  # the loop tests' run length: the step function is already compiled
# Steps of ~0.1 s on 2 CPU cores (small_run's 4 x 16 tokens took ~20 ms): the reference window
# spans only two steps, and a stall of the shared machine outside them must not count 4x.
BATCH, SEQ = 4, 128


@pytest.mark.slow
def test_logged_throughput_matches_the_wall_time_of_completed_steps(tmp_path, monkeypatch):
    batch_calls, save_times, bar_updates = {}, [], []
    next_batch, save, update = Trainer.next_batch, Trainer.save, Progress.update

    def timed_next_batch(self, step):
        batch_calls[step] = time.perf_counter()
        return next_batch(self, step)

    def timed_save(self, state):
        save_times.append(time.perf_counter())
        return save(self, state)

    def recorded_update(self, step, values=None):
        bar_updates.append((step, (values or {}).get("loss/lm")))
        return update(self, step, values)

    monkeypatch.setattr(Trainer, "next_batch", timed_next_batch)
    monkeypatch.setattr(Trainer, "save", timed_save)
    monkeypatch.setattr(Progress, "update", recorded_update)
    # peak_flops=0: measured, so MFU <= 1 is a real bound; checkpoints only where the run stops
    # and no evaluation, so the wall time between batch fetches and the save is all training.
    run = small_run(f"train.steps={STEPS}", "train.log_every=1", "train.checkpoint_every=100",
                    "train.eval_every=0", "train.peak_flops=0", f"train.seq_len={SEQ}",
                    vocab=4096)
    losses = []
    for first, stop_after in ((0, STOP), (STOP, None)):  # a run, then its resumption
        batch_calls.clear(), save_times.clear(), bar_updates.clear()
        summary = train(run, tmp_path, stop_after=stop_after)
        assert summary.first_step == first
        # Steps after the compiling one, timed here from the call that fetched their batch to
        # the final save (which comes after the loop waited for the last step).
        timed = summary.last_step - first - 1
        reference = timed * BATCH * SEQ / (save_times[-1] - batch_calls[first + 1])
        records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text()
                   .splitlines()][first:]
        rated = [r for r in records if "tokens_per_sec" in r]
        # log_every=1: the rows of the compiling step and of the next have no finished step to
        # time yet; every later row has a rate.
        assert [r["step"] for r in rated] == list(range(first + 3, summary.last_step + 1))
        for record in rated:
            assert reference / 4 < record["tokens_per_sec"] < 4 * reference, (record, reference)
            assert 0 < record["mfu"] <= 1
        lm_losses = {r["step"]: r["loss/lm"] for r in records}  # log_every=1: every step
        for step, loss in bar_updates:
            if loss is not None:
                assert float(loss) == lm_losses[step], (step, loss, lm_losses)
        assert bar_updates[-1][0] == summary.last_step
        losses += summary.losses
    assert len(losses) == STEPS
