"""Fault injection, part 2: damaged files of every kind the project reads (nothing saved
is lost): orbax checkpoint items, metrics.jsonl, tokenizer.json, and a Hugging Face checkpoint's
safetensors shards and config.json.

Each test damages one file the way a crash, a full disk or a bad copy would, checks that the
command reading it ends in one `error:` line that names it (exit 2) with nothing on disk
changed, then repairs what the message says to repair and checks that nothing was lost: the
resumed run's per-step losses equal an uninterrupted run's, exactly. Run alone with part 1:
`python -m pytest -m faults`.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from fault_helpers import RUN, logged_losses, reference, run_args
from hf_step3p5_checkpoint import random_tensors, write_hf_dir
from train_helpers import TINY

from model.hf import main as hf_main
from model.interop.workdir_lock import LOCK_FILE
from train.__main__ import main as train_main
from train.config import load_run_config
from train.experiments.plot import main as plot_main
from train.loop import train

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.xdist_group("faults")]
__all__ = ["reference"]  # a fixture

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[2] / "model" / "tokenizers" / "assets"


def _digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def _one_line_error(capsys, *needles: str) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A copy of the shipped tokenizer, so that a test may damage it."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    shutil.copyfile(SHIPPED_TOKENIZER / "stdlib_bpe_4096.json", path)
    return path


def _run_args(workdir: Path, tokenizer: Path) -> list[str]:
    return run_args(workdir, f"train.data.tokenizer={tokenizer}")


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, tokenizer_file) -> Path:
    """A workdir of the reference run (tokenizer read from `tokenizer_file`, a copy of the same
    file) stopped after step 4, with checkpoints at steps 2 and 4."""
    half = tmp_path_factory.mktemp("half")
    run = load_run_config(TINY, [*RUN, f"train.data.tokenizer={tokenizer_file}"])
    assert train(run, half, stop_after=4).last_step == 4
    return half


@pytest.fixture
def half_run(stopped_run, tmp_path) -> Path:
    workdir = tmp_path / "run"
    shutil.copytree(stopped_run, workdir)
    return workdir


def _resume_to_the_end(workdir: Path, tokenizer: Path, reference: dict[int, float]) -> None:
    assert train_main(_run_args(workdir, tokenizer)) == 0
    assert logged_losses(workdir) == reference  # every step, exactly


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("item", ["state", "data", "config"])
def test_damaged_checkpoint_item(reference, half_run, tokenizer_file, tmp_path, capsys, item):
    step_dir = half_run / "checkpoints" / "4"
    _truncate(_largest_file(step_dir / item))
    before = _digest(half_run)
    assert train_main(_run_args(half_run, tokenizer_file)) == 2
    _one_line_error(capsys, str(step_dir))
    assert _digest(half_run) == before
    step_dir.rename(tmp_path / "damaged-4")  # what the message tells the user to do
    _resume_to_the_end(half_run, tokenizer_file, reference)


def test_torn_metrics_line(reference, half_run, tokenizer_file, capsys):
    """A process killed while appending leaves half a line; the resume drops it and the plot
    reads the file."""
    with open(half_run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 10.7')
    _resume_to_the_end(half_run, tokenizer_file, reference)
    assert plot_main(["--workdir", str(half_run), "--out", str(half_run / "plot.png")]) == 0
    assert (half_run / "plot.png").stat().st_size > 0


def test_damaged_tokenizer(reference, half_run, tokenizer_file, capsys):
    intact = tokenizer_file.read_bytes()
    _truncate(tokenizer_file)
    try:
        before = _digest(half_run)
        assert train_main(_run_args(half_run, tokenizer_file)) == 2
        _one_line_error(capsys, str(tokenizer_file))
        assert _digest(half_run) == before
    finally:
        tokenizer_file.write_bytes(intact)
    _resume_to_the_end(half_run, tokenizer_file, reference)


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    return write_hf_dir(tmp_path / "hf", random_tensors())


def _shard(hf_dir: Path) -> Path:
    return sorted(hf_dir.glob("*.safetensors"))[0]


@pytest.mark.parametrize("damage", ["truncated shard", "shard header", "config.json"])
def test_damaged_hf_checkpoint(hf_dir, tmp_path, capsys, damage):
    out = tmp_path / "model"
    if damage == "truncated shard":
        victim = _shard(hf_dir)
        _truncate(victim)
    elif damage == "shard header":
        victim = _shard(hf_dir)
        victim.write_bytes(b"\xff" * 8 + victim.read_bytes()[8:])  # header length garbage
    else:
        victim = hf_dir / "config.json"
        victim.write_text(victim.read_text()[:-20])
    assert hf_main(["import", str(hf_dir), "--out", str(out)]) == 2
    _one_line_error(capsys, victim.name)
    assert not out.exists()


def test_hf_import_after_repair(hf_dir, tmp_path, capsys):
    """The same source, damaged then restored: the import refused first succeeds after."""
    shard = _shard(hf_dir)
    intact = shard.read_bytes()
    _truncate(shard)
    assert hf_main(["import", str(hf_dir), "--out", str(tmp_path / "model")]) == 2
    capsys.readouterr()
    shard.write_bytes(intact)
    assert hf_main(["import", str(hf_dir), "--out", str(tmp_path / "model")]) == 0
