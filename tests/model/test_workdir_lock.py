"""The workdir lock on its own: a second writer is refused with the holder named, the lock ends
with the block, and a holder killed with SIGKILL leaves no lock in force."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from model.interop.workdir_lock import LOCK_FILE, WorkdirInUse, workdir_lock

REPO = Path(__file__).resolve().parents[2]
HOLDER = """
import sys, time
from pathlib import Path
from model.interop.workdir_lock import workdir_lock
with workdir_lock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_the_lock_ends_with_the_block_and_names_its_holder(tmp_path):
    with workdir_lock(tmp_path):
        holder = (tmp_path / LOCK_FILE).read_text()
        assert f"pid {os.getpid()} on " in holder
        with pytest.raises(WorkdirInUse, match=f"in use by pid {os.getpid()} on "):
            with workdir_lock(tmp_path):  # another open file: flock refuses it
                pass
    with workdir_lock(tmp_path):  # released: the same process takes it again
        pass


def test_a_second_writer_is_refused_and_a_killed_holder_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(WorkdirInUse) as refused:
            with workdir_lock(tmp_path):
                pytest.fail("took a lock another process holds")
        message = str(refused.value)
        assert f"workdir {tmp_path} is in use by pid {holder.pid} on " in message
        assert "\n" not in message and "another --workdir" in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with workdir_lock(tmp_path):  # the kernel dropped the dead holder's lock
        assert f"pid {os.getpid()} on " in (tmp_path / LOCK_FILE).read_text()
