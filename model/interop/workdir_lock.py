"""One writer per workdir: an advisory lock on `DIR/.lock`, held while a command writes `DIR`.

The lock is `fcntl.flock` on an open descriptor, so the operating system drops it when the
holder exits, however it exits (SIGKILL and crashes included): a lock left by a killed process
is never in force, and the next writer takes it over without any staleness guess. The file keeps
the holder's host, pid, start time and command, which a second writer's error names. The file
itself stays (removing it while another process waits on it would let two writers in).

`claimed_workdir` creates the workdir, checks that it is writable and holds its lock; a workdir
it created is removed again when the command fails before writing anything there, so a refused
run leaves nothing behind (not even the lock file).

Multi-host runs write one workdir from every process under process 0's control; process 0
holds the lock for all of them. flock works on local filesystems and on most network mounts
(NFSv4 emulates it with byte-range locks); where it is unsupported the error says so.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Iterator

import jax

LOCK_FILE = ".lock"


class WorkdirInUse(RuntimeError):
    """Another process is writing the workdir (or its lock cannot be taken)."""


def _holder_description() -> str:
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    command = " ".join(sys.argv)[:300]
    return f"pid {os.getpid()} on {socket.gethostname()}, started {started}: {command}"


@contextlib.contextmanager
def workdir_lock(workdir: Path, option: str = "--workdir") -> Iterator[None]:
    """Holds `workdir`'s lock for the block (on process 0 only; the workdir must exist).
    Raises WorkdirInUse naming the holder if another process holds it (and the command-line
    `option` that chose `workdir`)."""
    if jax.process_index() != 0:
        yield
        return
    path = Path(workdir) / LOCK_FILE
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = path.read_text(errors="replace").strip() or "another process"
                raise WorkdirInUse(f"workdir {workdir} is in use by {holder}; wait for it to "
                                   f"finish or use another {option}") from None
            raise WorkdirInUse(f"cannot lock workdir {workdir} ({err.strerror}); this "
                               "filesystem may not support file locks") from None
        os.ftruncate(descriptor, 0)
        os.write(descriptor, (_holder_description() + "\n").encode())
        yield
    finally:
        os.close(descriptor)  # releases the lock


@contextlib.contextmanager
def claimed_workdir(workdir: Path, option: str = "--workdir") -> Iterator[None]:
    """Creates `workdir` if needed (every process), checks that this process can write it
    (OSError naming it), and holds its lock (`workdir_lock`) for the block. If the block fails
    and the directories it created hold nothing but the lock, they are removed again."""
    workdir = Path(workdir)
    created = workdir
    while not created.parent.exists() and created.parent != created:
        created = created.parent  # the outermost directory this call creates
    if workdir.exists():
        created = None
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write-test-{jax.process_index()}"  # processes may share workdir
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise OSError(f"workdir {workdir} is not writable: {err.strerror or err}") from None
    with workdir_lock(workdir, option):
        try:
            yield
        except BaseException:
            if (created is not None and jax.process_index() == 0
                    and [p.name for p in workdir.iterdir()] == [LOCK_FILE]):
                shutil.rmtree(created)  # still under the lock: nobody else writes here
            raise
