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
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fault_helpers import RUN, logged_losses, reference, run_args
from hf_step3p5_checkpoint import HF_CONFIG, random_tensors, write_hf_dir
from train_helpers import REPO, TINY

from model.hf import main as hf_main
from model.interop.workdir_lock import LOCK_FILE
from train.__main__ import main as train_main
from train.config import load_run_config
from train.experiments.plot import main as plot_main
from train.loop import train

pytestmark = [pytest.mark.faults, pytest.mark.slow]
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


@pytest.mark.parametrize("shard", ["../x.safetensors", "/etc/x.safetensors", "a/../../x"])
def test_hf_index_pointing_outside_the_checkpoint(hf_dir, tmp_path, capsys, shard):
    index = hf_dir / "model.safetensors.index.json"
    values = json.loads(index.read_text())
    name = sorted(values["weight_map"])[0]
    values["weight_map"][name] = shard
    index.write_text(json.dumps(values))
    out = tmp_path / "model"
    assert hf_main(["import", str(hf_dir), "--out", str(out)]) == 2
    _one_line_error(capsys, f"{index}: weight_map sends {name} to {shard!r}, which is not a "
                    f"file name inside {hf_dir}")
    assert not out.exists()


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_hf_tensors_holding_nan_or_inf(tmp_path, capsys, bad):
    tensors = random_tensors()
    name = "model.layers.2.moe.up_proj.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][1, 2, 3] = bad
    hf_dir = write_hf_dir(tmp_path / "hf", tensors)
    out = tmp_path / "model"
    assert hf_main(["import", str(hf_dir), "--out", str(out)]) == 2
    *progress, error = capsys.readouterr().err.strip().splitlines()  # the bar ends its line
    assert error == (f"error: {name} (in model-00001-of-00002.safetensors): 1 of "
                     f"{tensors[name].size} values are NaN or infinite; the checkpoint is "
                     "damaged, download or export it again")
    assert all(line.startswith("import:") for line in progress), progress
    assert not out.exists()


@pytest.mark.parametrize("config, needle", [
    ([1, 2], "config.json: expected a JSON object, got list"),
    ({**HF_CONFIG, "num_hidden_layers": 5.0}, "num_hidden_layers: expected an integer, got 5.0"),
    ({**HF_CONFIG, "hidden_size": "32"}, "hidden_size: expected an integer, got '32'"),
    ({**HF_CONFIG, "num_hidden_layers": 10**12}, "num_hidden_layers: expected 1 to 10000"),
    ({**HF_CONFIG, "rope_scaling": "llama3"}, "config.json: a value does not fit its key"),
])
def test_hf_config_json_values_of_the_wrong_type(tmp_path, capsys, config, needle):
    hf_dir = write_hf_dir(tmp_path / "hf", random_tensors())
    (hf_dir / "config.json").write_text(json.dumps(config))
    out = tmp_path / "model"
    assert hf_main(["import", str(hf_dir), "--out", str(out)]) == 2
    _one_line_error(capsys, needle)
    assert not out.exists()


# model.hf import and export with writes past 64 KiB failing (EFBIG, as a full disk's ENOSPC):
# config.json fits, the tensors do not.
HF_FILE_SIZE_LIMITED = r"""
import contextlib, io, json, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
from model.hf import main
results = []
for command, source, out in (("import", sys.argv[1], sys.argv[3]),
                             ("export", sys.argv[2], sys.argv[4])):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([command, source, "--out", out])
    results.append([code, err.getvalue().strip().splitlines()[-1]])
print(json.dumps(results))
"""


def test_full_disk_in_model_hf(hf_dir, tmp_path):
    model = tmp_path / "model"
    assert hf_main(["import", str(hf_dir), "--out", str(model)]) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}  # no cache writes
    done = subprocess.run([sys.executable, "-c", HF_FILE_SIZE_LIMITED, str(hf_dir), str(model),
                           str(tmp_path / "imported"), str(tmp_path / "exported")], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for (code, line), out in zip(json.loads(done.stdout), ("imported", "exported")):
        assert code == 2 and line.startswith(f"error: writing {tmp_path / out} failed ("), line
        assert line.endswith("File too large, errno EFBIG); nothing was written there: free "
                             "disk space and re-run"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model"]  # no partial output
