"""`python -m train.plan --measure`: the step it compiles is the one training compiles, and its
refusals."""

from __future__ import annotations

import numpy as np
from train_helpers import SMALL_LOOP, TINY

from model.parallel.rules import use_mesh
from train.compiled_step import lower_train_step, step_layout
from train.config import load_run_config
from train.loop import Trainer
from train.parallel.plan import main


def test_training_compiles_the_step_measure_lowers(tmp_path):
    """The Trainer's jitted step called on real arrays (initial state, first batch) lowers to
    the same program as --measure's, lowered from shapes alone."""
    run = load_run_config(TINY, [*SMALL_LOOP, "train.batch_size=4", "train.micro_batch_size=2"])
    (tmp_path / "run").mkdir()
    trainer = Trainer(run, tmp_path / "run")
    try:
        with use_mesh(trainer.mesh):
            batch, _ = trainer.next_batch(0)
            assert batch["tokens"].shape == (2, 2, 16)  # two accumulated micro-batches
            real = trainer.train_step().lower(trainer.initial_state(), batch, np.bool_(False))
            measured = lower_train_step(step_layout(run, trainer.mesh), run)
    finally:
        trainer.checkpoints.close()
    assert measured.as_text() == real.as_text()


def test_measure_refuses_a_mesh_larger_than_the_host_before_tracing(capsys):
    assert main(["--config", str(TINY), "--mesh", "data=2,expert=2", "--measure"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("error: --measure: the mesh needs 4 devices, this host has 1 cpu")
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=4" in err
