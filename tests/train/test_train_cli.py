"""Bad input to `python -m train`, `train.eval` and `train.tokenizer` that ends before any work:
one line `error: ...` (a bare `python -m train` also shows its usage), exit code 2, and nothing
created or changed."""

from __future__ import annotations

import numpy as np
import pytest
from train_helpers import SMALL_MODEL, TINY

from model.interop.workdir import Checkpointer
from model.summary import main as summary_main
from train.__main__ import main as train_main
from train.eval import main as eval_main
from train.tokenizer import main as tokenizer_main


def _error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _exit_code(main, argv) -> int:
    """Exit code of `main(argv)`, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exit_info:
        return exit_info.code


def test_bare_train_prints_its_usage_then_one_error_line(capsys):
    assert _exit_code(train_main, []) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: python -m train ")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: --config PATH (or --recipe PATH) and --workdir DIR are required"]
    assert err.endswith(errors[0] + "\n")


@pytest.mark.parametrize("text", ["", "train: {steps: 2}\n"])
def test_a_config_without_a_model_is_refused_before_any_work(tmp_path, capsys, text):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    workdir = tmp_path / "run"
    for main, argv in ((train_main, ["--config", str(config), "--workdir", str(workdir)]),
                       (summary_main, ["--config", str(config)])):
        assert _exit_code(main, argv) == 2
        out, err = capsys.readouterr()
        line = _error_line(err)
        assert out == "" and f"config file {str(config)!r} defines no model" in line
        assert "configs/tiny.yaml" in line and "configs/step35_flash.yaml" in line
    assert not workdir.exists()


def test_a_config_directory_is_named_as_such(tmp_path, capsys):
    workdir = tmp_path / "run"
    for main, argv in ((train_main, ["--config", str(tmp_path), "--workdir", str(workdir)]),
                       (summary_main, ["--config", str(tmp_path)])):
        assert _exit_code(main, argv) == 2
        line = _error_line(capsys.readouterr().err)
        assert line == (f"error: config file {str(tmp_path)!r} is a directory; expected a YAML "
                        "file such as configs/tiny.yaml")
    assert not workdir.exists()


def test_a_run_failing_before_it_writes_leaves_no_workdir(tmp_path, capsys):
    workdir = tmp_path / "new" / "run"  # both directories are the run's
    code = train_main(["--config", str(TINY), "--workdir", str(workdir), *SMALL_MODEL,
                       "train.steps=2", "train.warmup_steps=1", "train.progress=false",
                       f"train.data.source={tmp_path / 'missing.jsonl'}"])
    assert code == 2 and "does not exist" in _error_line(capsys.readouterr().err)
    assert not workdir.parent.exists()  # not even the lock file


def test_eval_of_an_unsaved_step_lists_the_saved_ones(tmp_path, capsys):
    checkpoints = Checkpointer(tmp_path / "checkpoints", keep=5)
    for step in (2, 4):
        checkpoints.save(step, {"w": np.ones(3, np.float32)}, {}, {})
    checkpoints.close()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert eval_main(["--workdir", str(tmp_path), "--step", "99"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and _error_line(err) == (
        f"error: --step 99: {tmp_path} has no checkpoint of that step; saved steps: 2, 4")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_eval_without_checkpoints_creates_nothing(tmp_path, capsys):
    assert eval_main(["--workdir", str(tmp_path)]) == 2
    assert "no checkpoint in" in _error_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_tokenizer_heldout_fraction_has_the_config_check_and_message(tmp_path, capsys):
    out = tmp_path / "tokenizer.json"
    assert _exit_code(tokenizer_main, ["--heldout-fraction", "1.5", "--out", str(out)]) == 2
    assert _error_line(capsys.readouterr().err) == ("error: --heldout-fraction: must be a number "
                                                    "strictly between 0 and 1, got 1.5")
    assert not out.exists()
