"""The run the fault-injection tests (tests/train/test_faults*.py) interrupt, damage and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_helpers import SMALL_MODEL, TINY

from train.__main__ import main as train_main

STEPS = 6
# The settings of tests/train/test_train.py's loop runs (checkpoints at steps 2, 4, 6), so the
# step function compiled there is found in the persistent cache here.
RUN = [*SMALL_MODEL, "model.vocab_size=4096", "train.seq_len=16", "train.batch_size=4",
       "train.warmup_steps=2", f"train.steps={STEPS}", "train.progress=false",
       "train.peak_flops=1e9", "train.log_every=1", "train.checkpoint_every=2"]
WAIT_S = 600  # a generous bound for a 2-core CI machine compiling the step


def run_args(workdir: Path, *extra: str) -> list[str]:
    return ["--config", str(TINY), "--workdir", str(workdir), *RUN, *extra]


def logged_losses(workdir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows]
    assert steps == sorted(set(steps)), f"metrics.jsonl repeats or reorders steps: {steps}"
    return {row["step"]: row["loss"] for row in rows}




@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict[int, float]:
    """Per-step losses of the uninterrupted run (the fault modules import this fixture)."""
    workdir = tmp_path_factory.mktemp("reference")
    assert train_main(run_args(workdir)) == 0
    losses = logged_losses(workdir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses
