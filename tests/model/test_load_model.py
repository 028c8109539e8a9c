"""Tests of the one model loader (`model.weights.load_model`): it reads a Hugging Face
directory, a model directory and a `python -m train` workdir (its latest step or a step named
as `DIR/checkpoints/<step>`) alike, and their configs alone (`load_model_config`), places the
training shardings when given a mesh (8 host devices in a subprocess, tests/hf_sharded_import_worker.py)
and rejects other paths in one line. The Hugging Face source is the hand-written checkpoint of
tests/hf_step3p5_checkpoint.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from hf_step3p5_checkpoint import (
    EXPERTS,
    REPO,
    assert_same_variables,
)

from model.config import config_to_dict
from model.interop.workdir import CheckpointError
from model.weights import load_model, load_model_config, save_model_dir


def make_workdir(path: Path, config, variables) -> Path:
    """A `python -m train` workdir with one checkpoint whose state holds `variables` (built with
    the trainer's Checkpointer and TrainState; no training step is needed)."""
    from model.interop.workdir import Checkpointer
    from train.config import run_config_from_dict
    from train.state import TrainState, build_training

    run = run_config_from_dict({"model": config_to_dict(config)})
    params = variables["params"]
    zero = jnp.zeros((), jnp.int32)
    state = TrainState(step=jnp.int32(3), params=params, balance=variables["balance"],
                       opt_state=build_training(run).optimizer.init(params),
                       rng=jax.random.key_data(jax.random.key(0)), skipped=zero,
                       consecutive_skips=zero)
    checkpoints = Checkpointer(path / "checkpoints", keep=2)
    checkpoints.save(3, state, {}, run.to_dict())
    checkpoints.close()
    return path


def test_load_model_reads_every_kind_of_directory(hf_source, imported, tmp_path):
    config, variables = imported
    save_model_dir(config, variables, tmp_path / "model")
    workdir = make_workdir(tmp_path / "run", config, variables)
    step = workdir / "checkpoints" / "3"  # a workdir's step, as `--init-from` names one
    for source in (hf_source[0], tmp_path / "model", workdir, step):
        got_config, got = load_model(source)
        assert got_config == config == load_model_config(source), source
        assert_same_variables(variables, got)
    with pytest.raises(CheckpointError, match="no checkpoint of step 4; saved steps: 3"):
        load_model(workdir / "checkpoints" / "4")


def test_load_model_with_a_mesh_places_the_training_shardings(tmp_path, imported):
    from train.config import MeshConfig
    from train.parallel.sharding import make_mesh

    config, variables = imported
    save_model_dir(config, variables, tmp_path / "model")
    mesh = make_mesh(MeshConfig())
    _, got = load_model(tmp_path / "model", mesh)
    assert_same_variables(variables, got)
    assert all(isinstance(a.sharding, jax.sharding.NamedSharding) for a in jax.tree.leaves(got))


@pytest.mark.parametrize("make, problem", [
    (lambda p: p / "absent", "does not exist"),
    (lambda p: p, "is not a model directory"),
])
def test_load_model_rejects_other_paths(tmp_path, make, problem):
    with pytest.raises(ValueError) as err:
        load_model(make(tmp_path))
    assert problem in str(err.value) and "\n" not in str(err.value)


SHARDED_WORKER = REPO / "tests" / "hf_sharded_import_worker.py"


@pytest.mark.slow
def test_sharded_import_on_eight_devices(hf_source, imported, tmp_path):
    """With a mesh, every variable is placed in its training sharding (experts split over the
    `expert` axis) and holds the same values; the model directory restores into it too. The
    8-device half runs in tests/hf_sharded_import_worker.py, which raises naming the variable
    and the values that differ, and reports what it compared."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    result = subprocess.run([sys.executable, str(SHARDED_WORKER), str(hf_source[0]),
                             str(tmp_path / "model")], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["devices"] == 8
    variables = len(jax.tree.leaves(imported[1]))  # every variable was compared, both times
    assert report["compared"] == {"import": variables, "restored": variables}
    assert report["not_named"] == {"import": [], "restored": []}
    # gate_proj [layers, E=8, D, H] of the scanned MoE segment: the experts split in two over
    # `expert`, 4 per shard.
    assert report["expert_shape"][1] == EXPERTS and report["expert_spec"][1] == "expert"
    assert [shape[1] for shape in report["expert_shard_shapes"]] == [EXPERTS // 2]
