"""`python -m train.plan --measure`: the step it compiles is the one training compiles, its
refusals, and the planner's estimate against XLA's compiled peak."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from train_helpers import SMALL_LOOP, TINY, run_device_worker

from model.parallel.rules import use_mesh
from train.compiled_step import lower_train_step, step_layout
from train.config import load_run_config
from train.loop import Trainer
from train.parallel.plan import main

WORKER = Path(__file__).resolve().parents[1] / "plan_measure_worker.py"


@pytest.mark.slow
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


# XLA:CPU's memory-minimising scheduler, the kind of schedule GPU and TPU compilers build
# (docs/parallelism.md, "Checking the estimate against XLA")
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
MESHES = ("data=8", "pipeline=2,data=4", "expert=4,data=2", "fsdp=4,data=2")
# the worker's run uses `dots`; the policies that save most and least on data=8 (the table in
# docs/parallelism.md has the others), the interleaved schedule (two virtual stages) beside
# GPipe on the pipeline mesh
CASES = (*MESHES, "data=8:model.remat_policy=none", "data=8:model.remat_policy=full",
         "pipeline=2,data=4:model.pipeline_virtual_stages=2")


@pytest.mark.slow
def test_estimate_within_a_quarter_of_xla_on_meshes_policies_and_schedules():
    """The planner's per-device total against XLA's compiled peak, one 8-device worker compiling
    the step of the tiny preset at d_model 256 (tests/plan_measure_worker.py) for every case."""
    results = run_device_worker(WORKER, 8, *CASES, xla_flags=MEMORY_SCHEDULER)
    ratios = {}
    for case in CASES:
        result = results[case]
        measured = result["measured"]
        assert result["code"] == 0 and MEMORY_SCHEDULER in measured["xla_flags"]
        assert measured["peak_bytes"] == (measured["argument_bytes"] + measured["output_bytes"]
                                          - measured["alias_bytes"] + measured["temp_bytes"])
        # the donated state is written in place: the new state aliases all but the metrics
        assert 0 < measured["output_bytes"] - measured["alias_bytes"] < 2**20
        ratios[case] = result["total"] / measured["peak_bytes"]
    assert all(0.75 <= r <= 1.25 for r in ratios.values()), ratios
    assert results["pipeline=2,data=4"]["pipeline"]["stages"] == 2
    assert results[CASES[-1]]["pipeline"]["virtual_stages"] == 2
