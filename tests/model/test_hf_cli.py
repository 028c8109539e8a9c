"""Tests of the Hugging Face checkpoint command line (`python -m model.hf import|export`): help,
an import/export round trip that is tensor-exact, and bad input reported in one line without
writing anything. The source directory is the hand-written checkpoint of
tests/hf_step3p5_checkpoint.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from hf_step3p5_checkpoint import REPO, assert_same_tensors, read_dir

from model.generate import main as generate_main
from model.hf import main
from model.interop.workdir_lock import LOCK_FILE, workdir_lock


def test_cli_help():
    result = subprocess.run([sys.executable, "-m", "model.hf", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "import" in result.stdout and "export" in result.stdout


def test_cli_import_then_export_round_trips(hf_source, tmp_path):
    hf_dir, _ = hf_source
    assert main(["import", str(hf_dir), "--out", str(tmp_path / "model")]) == 0
    assert main(["export", str(tmp_path / "model"), "--out", str(tmp_path / "hf"),
                 "--dtype", "bfloat16"]) == 0
    assert_same_tensors(read_dir(hf_dir), read_dir(tmp_path / "hf"))
    # Every exported file is readable by others as umask 022 allows (safetensors alone: 0600).
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()
             if p.name != LOCK_FILE}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_cli_bad_input_is_one_line_and_writes_nothing(hf_source, tmp_path, capsys):
    assert main(["import", str(tmp_path / "nowhere"), "--out", str(tmp_path / "model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "nowhere" in err and err.count("\n") == 1
    assert not (tmp_path / "model").exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("keep")
    assert main(["import", str(hf_source[0]), "--out", str(taken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "not empty" in err and err.count("\n") == 1
    assert [p.name for p in taken.iterdir()] == ["x"]


@pytest.mark.parametrize("value, problem", [
    ("nan", "argument --max-shard-gib: must be a finite number, got 'nan'"),
    ("inf", "argument --max-shard-gib: must be a finite number, got 'inf'"),
    ("1e-300", "--max-shard-gib must be at least one byte (2^-30), got 1e-300"),
])
def test_a_shard_size_that_is_no_number_of_bytes_is_named(hf_source, tmp_path, capsys, value,
                                                           problem):
    try:
        code = main(["export", str(hf_source[0]), "--out", str(tmp_path / "hf"),
                     f"--max-shard-gib={value}"])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    assert capsys.readouterr().err == f"error: {problem}\n"
    assert not (tmp_path / "hf").exists()


def test_truncated_shard_is_one_line_naming_it_in_import_and_generate(hf_source, tmp_path,
                                                                      capsys):
    cut = tmp_path / "cut"
    shutil.copytree(hf_source[0], cut)
    shard = cut / "model-00002-of-00002.safetensors"
    full_size = shard.stat().st_size
    with open(shard, "r+b") as f:  # an interrupted download: the data stops early
        f.truncate(full_size - 100)
    commands = {"import": lambda: main(["import", str(cut), "--out", str(tmp_path / "model")]),
                "generate": lambda: generate_main(["--hf", str(cut), "--prompt", "hi"])}
    for name, command in commands.items():
        assert command() == 2, name
        captured = capsys.readouterr()
        err = captured.err
        assert err.startswith(f"error: {shard}: truncated") and err.count("\n") == 1, err
        assert f"declares {full_size} bytes, the file has {full_size - 100}" in err
        assert captured.out == ""
    assert not (tmp_path / "model").exists()


def test_cli_refuses_an_output_directory_another_command_is_writing(hf_source, tmp_path, capsys):
    """The output directory takes the workdir lock: a second writer is refused in one line
    naming the holder, before loading anything; the finished export keeps working."""
    out = tmp_path / "hf"
    out.mkdir()
    with workdir_lock(out):
        assert main(["import", str(hf_source[0]), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: workdir {out} is in use by pid {os.getpid()} on ")
        assert err.count("\n") == 1 and "another --out" in err
    assert [p.name for p in out.iterdir()] == [LOCK_FILE]
    assert main(["import", str(hf_source[0]), "--out", str(tmp_path / "model")]) == 0
    assert main(["export", str(tmp_path / "model"), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert_same_tensors(read_dir(hf_source[0]), read_dir(out))
