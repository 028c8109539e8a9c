"""`python -m train.data.prepare` under faults: every error is one line and leaves what was
prepared resumable (a file as --out, non-finite numbers, a full or read-only disk, Ctrl-C), one
preparation at a time holds an --out, and its worker processes stop on Ctrl-C and die with it
when it is killed. Tiny corpora in tmp_path; nothing compiles."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shard_helpers import prepared, write_corpus

import train.data.prepare as prepare_module
import train.data.shards as shards
from model.interop.workdir_lock import workdir_lock

WORKER_SCRIPT = Path(__file__).resolve().parents[1] / "prepare_pool_worker.py"
DEADLINE_S = 60  # generous for a loaded 2-core machine; the workers stop in well under 1 s


def run_main(capsys, *args: str) -> tuple[int, str]:
    try:
        code = prepare_module.main(["--workers", "1", "--no-progress", *args])
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 1, err
    return code, err[0] if err else ""


def test_bad_flags_and_failing_disks_are_one_line_and_the_work_stays_resumable(
        tmp_path, capsys, monkeypatch):
    source = write_corpus(tmp_path / "raw")
    out = tmp_path / "out"
    base = ["--source", source, "--out", str(out), "--unit-mb", str(40_000 / 2**20),
            "--heldout-fraction", "0.3"]
    (tmp_path / "a_file").write_text("x")
    assert run_main(capsys, "--source", source, "--out", str(tmp_path / "a_file")) == (
        2, f"error: --out {tmp_path / 'a_file'} is a file; name a new or empty directory")
    for value in ("inf", "nan", "-inf", "1e999"):
        code, err = run_main(capsys, *base, f"--unit-mb={value}")
        assert (code, err) == (2, f"error: argument --unit-mb: must be a finite number, got "
                                  f"{value!r}")
    code, err = run_main(capsys, *base, "--heldout-fraction=nan")
    assert code == 2 and err.startswith("error: argument --heldout-fraction: must be a finite")
    assert not out.exists()
    # A full disk in the middle: one line naming the file and the reason; the units written
    # before it are kept and the next run finishes the rest.
    calls = []
    close = shards.ShardWriter.close

    def full_disk(writer):
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(writer.root / "x.partial"))
        calls.append(writer)
        return close(writer)

    monkeypatch.setattr(shards.ShardWriter, "close", full_disk)
    code, err = run_main(capsys, *base)
    assert (code, err) == (2, f"error: {out / 'x.partial'}: No space left on device, errno "
                              "ENOSPC")
    # A read-only filesystem (root ignores file modes, so the error is injected too).
    monkeypatch.undo()

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(out / "shards" / "00001.done"))

    monkeypatch.setattr(prepare_module, "write_text_atomically", read_only)
    code, err = run_main(capsys, *base)
    assert (code, err) == (2, f"error: {out / 'shards' / '00001.done'}: Read-only file system, "
                              "errno EROFS")
    # Ctrl-C: exit 130, one line.
    monkeypatch.undo()

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "prepare_unit", interrupted)
    assert run_main(capsys, *base) == (130, "error: interrupted; the units prepared so far are "
                                            "kept: run the same command again to finish")
    monkeypatch.undo()
    logs = []
    manifest = prepared(source, out, log=logs.append)
    assert logs[0].startswith("resuming: 1 of ")  # the unit finished before the disk filled
    assert manifest["splits"] == prepared(source, tmp_path / "ref")["splits"]  # byte for byte


def test_one_preparation_at_a_time_holds_an_out(tmp_path, capsys, monkeypatch):
    source = write_corpus(tmp_path / "raw")
    out = tmp_path / "out"
    monkeypatch.setattr(prepare_module, "prepare_unit", lambda *args: signal.raise_signal(
        signal.SIGINT))
    # one worker: the interrupting unit runs in this process, whatever the machine's core count
    args = ["--source", source, "--out", str(out), "--workers", "1"]
    code, err = run_main(capsys, *args)
    assert code == 130, err  # a preparation to finish
    monkeypatch.undo()
    before = sorted(p.name for p in out.rglob("*"))
    with workdir_lock(out, "--out"):  # another preparation is finishing it
        code, err = run_main(capsys, *args)
    assert code == 2 and f"is in use by pid {os.getpid()} on " in err, err
    assert err.endswith("wait for it to finish or use another --out")
    assert sorted(p.name for p in out.rglob("*")) == before  # nothing redone or truncated
    assert run_main(capsys, *args)[0] == 0 and (out / "manifest.json").is_file()
    # A directory holding anything else is still refused, and not even locked.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    code, err = run_main(capsys, "--source", source, "--out", str(tmp_path / "mine"))
    assert code == 2 and "is not empty and holds no prepared corpus" in err
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _started_workers(notes: Path) -> list[int]:
    deadline = time.monotonic() + DEADLINE_S
    while len(list(notes.glob("*.pid"))) < 2:
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.1)
    return [int(p.stem) for p in notes.glob("*.pid")]


def _wait_gone(pids: list[int]) -> float:
    start = time.monotonic()
    while any(_alive(p) for p in pids):
        assert time.monotonic() - start < DEADLINE_S, f"workers {pids} outlived their parent"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.slow
def test_workers_stop_on_ctrl_c_and_die_with_their_parent(tmp_path):
    """Real processes and signals: the pool's workers sleep in their task; Ctrl-C (SIGINT to the
    process group, as a terminal sends it) stops them with one exit code and no traceback, and
    after a kill -9 of the parent they die too instead of sleeping on."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for sig in (signal.SIGINT, signal.SIGKILL):
        notes = tmp_path / sig.name
        notes.mkdir()
        # stderr to a file: a worker that outlived its parent would hold a pipe open.
        with open(tmp_path / f"{sig.name}.err", "w") as stderr:
            parent = subprocess.Popen([sys.executable, str(WORKER_SCRIPT), str(notes)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=stderr,
                                      start_new_session=True)
        try:
            workers = _started_workers(notes)
            if sig == signal.SIGINT:
                os.killpg(parent.pid, sig)
            else:
                parent.kill()
            parent.wait(timeout=DEADLINE_S)
            _wait_gone(workers)
        finally:
            parent.kill()
            for pid in [int(p.stem) for p in notes.glob("*.pid")]:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
        assert parent.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL)
        stderr = (tmp_path / f"{sig.name}.err").read_text()
        assert "Traceback" not in stderr, stderr
