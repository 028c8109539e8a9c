"""Fault injection, part 1: processes killed, interrupted and contending (nothing saved is lost).

Run alone: `python -m pytest tests/train/test_faults.py tests/train/test_faults_files.py`
(or `-m faults`). Every test starts real `python -m train` processes on the small model of
`train_helpers.SMALL_MODEL` over the shipped corpus, hits them with one fault, checks what the
user sees, then resumes and asserts that nothing was lost: the losses of every step equal an
uninterrupted run's, exactly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from fault_helpers import RUN, STEPS, WAIT_S, logged_losses, reference, run_args
from train_helpers import REPO, TINY

from model.interop.workdir import Checkpointer
from model.interop.workdir_lock import LOCK_FILE
from train.__main__ import main as train_main
from train.config import load_run_config
from train.loop import train

# One worker of `make test` runs both fault modules (tests/suite_schedule.py), so they share the
# session's reference run.
pytestmark = [pytest.mark.faults, pytest.mark.slow]
__all__ = ["reference"]  # a fixture

def _start(code: str, *args: str) -> subprocess.Popen:
    """A Python child (inheriting XLA_FLAGS and the test cache settings) running `code`."""
    env = {**os.environ,
           "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(condition, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if process.poll() is not None:
            out, err = process.communicate()
            pytest.fail(f"the run ended (code {process.returncode}) before {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no {what} after {WAIT_S} s")
        time.sleep(0.05)


def _checkpoint_steps(workdir: Path) -> list[int]:
    checkpoints = Checkpointer(workdir / "checkpoints", keep=100)
    try:
        return checkpoints.all_steps()
    finally:
        checkpoints.close()


def _resume_and_compare(workdir: Path, reference: dict[int, float]) -> None:
    assert train_main(run_args(workdir)) == 0
    assert logged_losses(workdir) == reference  # every step, exactly
    assert _checkpoint_steps(workdir)[-1] == STEPS


# The child below holds the save of step 4 open at its last stage: orbax has written the files
# into a temporary directory and not yet renamed it into place (orbax 0.11-0.12 publishes a
# local checkpoint with `AtomicRenameTemporaryPath.finalize`; if that moves, this test fails
# loudly here rather than killing at some other moment).
SAVE_HELD_OPEN = r"""
import sys, time
from pathlib import Path
from orbax.checkpoint._src.path import atomicity
publish = atomicity.AtomicRenameTemporaryPath.finalize
async def finalize(self, *args, **kwargs):
    if Path(str(self.get_final())).name == "4":
        Path(sys.argv[1]).write_text("saving step 4")
        time.sleep(3600)
    return await publish(self, *args, **kwargs)
atomicity.AtomicRenameTemporaryPath.finalize = finalize
from train.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


def test_sigkill_during_an_asynchronous_save(tmp_path, reference):
    workdir, marker = tmp_path / "run", tmp_path / "marker"
    child = _start(SAVE_HELD_OPEN, str(marker), *run_args(workdir))
    _wait_for(marker.exists, child, "save of step 4")
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert _checkpoint_steps(workdir) == [2]  # the half-saved step 4 is not taken for one
    assert any(p.name.startswith("4.") for p in (workdir / "checkpoints").iterdir())
    _resume_and_compare(workdir, reference)


RUN_TRAIN = "import sys; from train.__main__ import main; sys.exit(main(sys.argv[1:]))"


def _interrupt_when(condition, workdir: Path, signals: list[int]) -> subprocess.Popen:
    child = _start(RUN_TRAIN, *run_args(workdir))
    _wait_for(condition, child, "the moment to interrupt")
    for number in signals:
        child.send_signal(number)
        time.sleep(0.5)
    child.wait(timeout=WAIT_S)
    return child


def _logged_steps(workdir: Path) -> int:
    path = workdir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_interrupt_at_step_time_saves_and_resumes(tmp_path, reference):
    """Ctrl-C here, SIGTERM in the next test: one handler serves both."""
    workdir = tmp_path / "run"
    child = _interrupt_when(lambda: _logged_steps(workdir) >= 1, workdir, [signal.SIGINT])
    out, err = child.communicate()
    assert child.returncode == 0, err
    assert "re-run the same command to resume" in out
    last = _checkpoint_steps(workdir)[-1]
    assert 1 <= last < STEPS and f"interrupted at step {last}" in out
    _resume_and_compare(workdir, reference)


def test_interrupt_during_set_up_and_compile_stops_and_resumes(tmp_path, reference):
    """Acknowledged at once, honoured after the first step (a second signal would exit at once:
    tests/train/test_interrupts.py)."""
    workdir = tmp_path / "run"
    child = _interrupt_when(lambda: (workdir / LOCK_FILE).exists(), workdir, [signal.SIGTERM])
    out, err = child.communicate()
    assert child.returncode == 0, err
    assert "received SIGTERM" in err and "re-run the same command to resume" in out
    _resume_and_compare(workdir, reference)


# Writes past 512 KiB fail with EFBIG, as they would with ENOSPC on a full disk, without root or
# a small filesystem: a checkpoint's array files are larger, its metadata and the metrics rows
# are not.
FILE_SIZE_LIMITED = r"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (512 << 10, 512 << 10))
from train.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_full_disk_while_saving(tmp_path, reference):
    workdir = tmp_path / "run"
    assert train(load_run_config(TINY, RUN), workdir, stop_after=2).last_step == 2
    child = _start(FILE_SIZE_LIMITED, *run_args(workdir))
    _, err = child.communicate(timeout=WAIT_S)
    lines = err.strip().splitlines()
    assert child.returncode == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"error: saving a checkpoint in {workdir / 'checkpoints'} failed")
    assert "File too large" in lines[0] and "up to step 2 are intact" in lines[0]
    assert _checkpoint_steps(workdir) == [2]
    _resume_and_compare(workdir, reference)


def test_two_writers(tmp_path, reference, capsys):
    workdir = tmp_path / "run"
    first = _start(RUN_TRAIN, *run_args(workdir))
    _wait_for(lambda: (workdir / LOCK_FILE).exists(), first, "the first run's lock")
    assert train_main(run_args(workdir, "train.lr=1e-2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"in use by pid {first.pid} on " in err[0], err
    out, err = first.communicate(timeout=WAIT_S)
    assert first.returncode == 0, err
    assert logged_losses(workdir) == reference  # the second writer changed nothing
