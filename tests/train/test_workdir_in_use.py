"""Every command that writes a workdir refuses one another process is writing, before writing
anything: `python -m train` (one-line error, exit 2), RL, sweeps and recipes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from train_helpers import REPO, SMALL_MODEL, TINY

from model.interop.workdir_lock import LOCK_FILE, WorkdirInUse, workdir_lock
from rl.config import load_rl_config
from rl.loop import run_rl
from train.__main__ import main as train_main
from train.experiments.recipe import load_recipe, run_recipe
from train.experiments.sweep import run_sweep
from train.experiments.sweep_file import load_sweep

IN_USE = f"is in use by pid {os.getpid()} on "


def _written(workdir: Path) -> list[str]:
    return sorted(p.name for p in workdir.iterdir() if p.name != LOCK_FILE)


def test_train_cli_refuses_a_workdir_in_use(tmp_path, capsys):
    with workdir_lock(tmp_path):
        code = train_main(["--config", str(TINY), "--workdir", str(tmp_path), *SMALL_MODEL,
                           "train.steps=2", "train.warmup_steps=1", "train.progress=false"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: workdir "), err
        assert IN_USE in err[0]
        assert _written(tmp_path) == []


def test_rl_sweep_and_recipe_refuse_a_workdir_in_use(tmp_path):
    commands = {
        "rl": lambda d: run_rl(load_rl_config(REPO / "configs" / "rl_arith.yaml"), d),
        "sweep": lambda d: run_sweep(load_sweep(REPO / "configs" / "sweeps" / "optimizer.yaml"),
                                     d, log=lambda _: None),
        "recipe": lambda d: run_recipe(load_recipe(REPO / "configs" / "recipes" /
                                                   "tiny_staged.yaml"), d, log=lambda _: None),
    }
    for name, command in commands.items():
        workdir = tmp_path / name
        workdir.mkdir()
        with workdir_lock(workdir):
            with pytest.raises(WorkdirInUse, match=IN_USE):
                command(workdir)
        assert _written(workdir) == [], name
