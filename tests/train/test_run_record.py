"""The tokenizer and data a workdir was trained on (`train.run_record`,
`model.interop.workdir_record`): a resume with another tokenizer or changed data is refused in
one line (exit 2) before anything compiles, unless `--allow-data-change`; `python -m rl
--init-from` and `python -m model.generate` refuse another tokenizer; old workdirs without a
record keep working."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from train_helpers import SMALL_LOOP, TINY

from model.generate import main as generate_main
from model.interop.workdir import latest_checkpoint_step
from model.interop.workdir_record import RECORD_FILE, read_record
from model.tokenizers.text import SHIPPED
from rl.__main__ import main as rl_main
from train.__main__ import main as train_main
from train.config import load_run_config
from train.loop import train

REPO = TINY.parents[1]


def small_args(workdir: Path, data: Path, tokenizer: Path) -> list[str]:
    """The sweep and recipe tests' 3-step run (its step is compiled once for all of them) on
    the files of `data` with the tokenizer file `tokenizer`."""
    return ["--config", str(TINY), "--workdir", str(workdir), *data_overrides(data, tokenizer)]


def data_overrides(data: Path, tokenizer: Path) -> list[str]:
    return [*SMALL_LOOP, f"train.data.source={data}", f"train.data.tokenizer={tokenizer}"]


def run_cli(capsys, main, args: list[str]) -> tuple[int, str, list[str]]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


def one_line_error(code: int, err: list[str], *needles: str) -> None:
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    for needle in needles:
        assert needle in err[0], err[0]


# Every test starts from the module's trained workdir (a 3-step run): all `slow`.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(workdir stopped after step 1 of 3, its data directory, its tokenizer file: a copy of
    the shipped default)."""
    root = tmp_path_factory.mktemp("recorded")
    data = root / "data"
    data.mkdir()
    for n in (1, 2, 3):
        (data / f"f{n}.txt").write_text("".join(f"{a}+{a}={2 * a}\n" for a in range(10 * n)))
    tokenizer = root / "tokenizer.json"
    shutil.copy(SHIPPED["default"], tokenizer)
    workdir = root / "run"
    run = load_run_config(TINY, data_overrides(data, tokenizer))
    assert train(run, workdir, stop_after=1).last_step == 1
    return workdir, data, tokenizer


@pytest.fixture
def copy(trained, tmp_path):
    """A private copy of the trained workdir, and a function restoring the shared data and
    tokenizer files after a test changed them."""
    workdir, data, tokenizer = trained
    mine = tmp_path / "run"
    shutil.copytree(workdir, mine)
    saved = {p: p.read_bytes() for p in [tokenizer, *data.iterdir()]}
    yield mine, data, tokenizer
    for path in data.iterdir():
        if path not in saved:
            path.unlink()
    for path, content in saved.items():
        path.write_bytes(content)


def test_first_start_records_the_tokenizer_and_the_data_files(trained):
    workdir, data, tokenizer = trained
    record = read_record(workdir)
    assert record["tokenizer"]["name"] == str(tokenizer)
    assert len(record["tokenizer"]["sha256"]) == 64
    files = record["data"]["fingerprint"]
    assert sorted(files) == [str(data / f"f{n}.txt") for n in (1, 2, 3)]
    content = (data / "f2.txt").read_bytes()
    assert files[str(data / "f2.txt")] == {"bytes": len(content),
                                           "sha256": hashlib.sha256(content).hexdigest()}


def test_resume_with_another_tokenizer_is_refused(copy, capsys):
    workdir, data, tokenizer = copy
    shutil.copy(SHIPPED["arith_chars"], tokenizer)  # same name, another vocabulary
    code, _, err = run_cli(capsys, train_main, small_args(workdir, data, tokenizer))
    one_line_error(code, err, "cannot resume", f"tokenizer '{tokenizer}' (sha256 ",
                   f"is not the one {workdir} was trained with")
    assert latest_checkpoint_step(workdir) == 1


def test_changed_data_is_refused_then_allowed_by_the_flag(copy, capsys):
    workdir, data, tokenizer = copy
    size = (data / "f2.txt").stat().st_size
    with open(data / "f2.txt", "a") as f:
        f.write("9+9=18\n")
    (data / "f4.txt").write_text("1+1=2\n")
    args = small_args(workdir, data, tokenizer)
    code, _, err = run_cli(capsys, train_main, args)
    one_line_error(code, err, f"cannot resume {workdir}: its data changed",
                   f"{data / 'f2.txt'} ({size} -> {size + 7} bytes)", f"{data / 'f4.txt'} added",
                   "--allow-data-change")
    assert latest_checkpoint_step(workdir) == 1

    code, _, err = run_cli(capsys, train_main, [*args, "--allow-data-change"])
    assert code == 0 and latest_checkpoint_step(workdir) == 3
    assert [line for line in err if line.startswith("note:")] == [
        f"note: {workdir} continues on changed data ({data / 'f2.txt'} ({size} -> {size + 7} "
        f"bytes), {data / 'f4.txt'} added); recorded the new data fingerprint"]
    assert read_record(workdir)["data"]["fingerprint"][str(data / "f4.txt")]["bytes"] == 6

    # The new data is now the recorded one: a plain re-run passes the check (and finds the
    # run finished).
    code, out, err = run_cli(capsys, train_main, args)
    assert code == 0 and "nothing to do" in out and not err, err


def test_a_workdir_without_a_record_still_resumes(copy, capsys):
    workdir, data, tokenizer = copy
    (workdir / RECORD_FILE).unlink()
    code, _, err = run_cli(capsys, train_main, small_args(workdir, data, tokenizer))
    assert code == 0 and latest_checkpoint_step(workdir) == 3, err
    assert any(line.startswith(f"note: {workdir} has no record") for line in err), err
    assert read_record(workdir)["tokenizer"]["name"] == str(tokenizer)


def test_rl_init_from_refuses_a_policy_of_another_tokenizer(trained, tmp_path, capsys):
    workdir, _, tokenizer = trained
    code, _, err = run_cli(capsys, rl_main, [
        "--config", str(REPO / "configs" / "rl_arith.yaml"), "--workdir", str(tmp_path / "rl"),
        "--init-from", str(workdir), "rl.tokenizer=arith_chars", "rl.progress=false"])
    one_line_error(code, err, "--init-from: tokenizer 'arith_chars' (sha256 ",
                   f"is not the one {workdir} was trained with, '{tokenizer}' (sha256 ",
                   "set rl.tokenizer")
    assert latest_checkpoint_step(tmp_path / "rl") is None


def test_generate_refuses_another_tokenizer_and_accepts_the_recorded_one(trained, capsys):
    workdir, _, tokenizer = trained
    args = ["--workdir", str(workdir), "--prompt", "1+1=", "--max-new-tokens", "1"]
    code, _, err = run_cli(capsys, generate_main, [*args, "--tokenizer", "arith_chars"])
    one_line_error(code, err, "--tokenizer: tokenizer 'arith_chars' (sha256 ",
                   f"{workdir} was trained with, '{tokenizer}'")
    for chosen in ([], ["--tokenizer", str(tokenizer)]):
        code, out, err = run_cli(capsys, generate_main, [*args, *chosen])
        assert code == 0 and out, err
    # a checkpoint named by its step: the same record, the tokenizer of that step's run config
    step = ["--workdir", str(workdir / "checkpoints" / "1"), *args[2:]]
    code, _, err = run_cli(capsys, generate_main, [*step, "--tokenizer", "arith_chars"])
    one_line_error(code, err, "--tokenizer: tokenizer 'arith_chars' (sha256 ",
                   f"{workdir} was trained with, '{tokenizer}'")
    code, out, err = run_cli(capsys, generate_main, step)
    assert code == 0 and out, err
