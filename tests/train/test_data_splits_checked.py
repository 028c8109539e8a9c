"""A data source whose held-out (or train) split is empty fails at start-up, in one line naming
the source and the fields to change, before any model work: `python -m train`, recipes (every
stage before the first trains) and sweeps (the run fails, the others go on)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from train_helpers import SMALL_LOOP, TINY

from model.interop.workdir import latest_checkpoint_step
from train.__main__ import main as train_main
from train.experiments.recipe import load_recipe, run_recipe
from train.experiments.sweep import run_sweep
from train.experiments.sweep_file import load_sweep


def one_document(tmp_path: Path) -> Path:
    """One short file: with heldout_fraction 0.05 its single document lands in the train split
    (heldout_score of "one.txt" is far above 0.05)."""
    path = tmp_path / "one.txt"
    path.write_text("def f(x):\n    return x\n")
    return path


def test_empty_heldout_split_is_refused_before_anything_is_written(tmp_path, capsys):
    source, workdir = one_document(tmp_path), tmp_path / "run"
    code = train_main(["--config", str(TINY), "--workdir", str(workdir), *SMALL_LOOP,
                       f"train.data.source={source}", "train.eval_every=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"error: train.data.source '{source}': 1 document(s) with "
                      "train.data.heldout_fraction=0.05 leave none held out for evaluation; "
                      "raise train.data.heldout_fraction, add documents or set "
                      "train.eval_every=0")
    assert latest_checkpoint_step(workdir) is None
    assert not (workdir / "metrics.jsonl").exists() and not (workdir / "run_record.json").exists()


def test_empty_train_split_names_the_fraction(tmp_path, capsys):
    source = one_document(tmp_path)
    code = train_main(["--config", str(TINY), "--workdir", str(tmp_path / "run"), *SMALL_LOOP,
                       f"train.data.source={source}", "train.data.heldout_fraction=0.99"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "leave 0 for training" in err[0] and "lower train.data.heldout_fraction" in err[0]


@pytest.mark.parametrize("reads_heldout", [
    ["train.eval_every=1"],  # the held-out evaluation, or samples from held-out rows
    ["train.eval_every=0", "train.sample_every=1", "train.samples.prompt_tokens=4",
     "train.samples.max_new_tokens=4"]])
def test_recipe_checks_every_stage_before_the_first_trains(tmp_path, reads_heldout):
    source = one_document(tmp_path)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"base": str(TINY), "overrides": SMALL_LOOP, "stages": [
        {"name": "first", "overrides": []},
        {"name": "second", "overrides": [f"train.data.source={source}", *reads_heldout]},
    ]}))
    workdir = tmp_path / "recipe"
    try:
        run_recipe(load_recipe(path), workdir, log=lambda _: None)
    except ValueError as err:
        assert str(err).startswith(f"recipe stage second: train.data.source '{source}'"), err
        assert "leave none held out" in str(err)
    else:
        raise AssertionError("the recipe ran")
    assert not workdir.exists()


def test_sweep_run_with_an_empty_heldout_split_fails_without_training(tmp_path):
    source = one_document(tmp_path)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": str(TINY), "overrides": [
        *SMALL_LOOP, f"train.data.source={source}"], "runs": [{"name": "only", "overrides": []}]}))
    outcome = run_sweep(load_sweep(path), tmp_path / "sweep", log=lambda _: None)
    assert list(outcome.failed) == ["only"], outcome
    assert "leave none held out for evaluation" in outcome.failed["only"]
    assert latest_checkpoint_step(tmp_path / "sweep" / "runs" / "only") is None
