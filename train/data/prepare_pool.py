"""The worker processes of `python -m train.data.prepare`: spawned, each running whole units of
work and reporting progress on a queue.

    run_in_processes(prepare_unit, tasks, workers=16, initializer=init, initargs=(...),
                     show=lambda input_bytes, tokens: ...)

Workers ignore Ctrl-C: the parent stops them and reports once (a unit they had not finished is
prepared again by the next run). They die with the parent however it ends, `kill -9` included,
instead of running on unseen (a worker imports the tokenizer's and the config's libraries: about
235 MB each): on Linux by the kernel's parent-death signal, elsewhere by a thread that watches
the parent's pid.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from typing import Callable, Iterator, Sequence

PR_SET_PDEATHSIG = 1  # prctl(2), <linux/prctl.h>
WATCH_SECONDS = 1.0  # how often the portable watch looks at the parent


def die_with_parent(parent: int) -> None:
    """Ends this process (SIGKILL on Linux, `os._exit` elsewhere) when process `parent`, which
    started it, ends."""
    watched = False
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        watched = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if not watched:
        threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # it ended before the watch was set
        os._exit(1)


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_SECONDS)
    os._exit(1)


def _start_worker(parent: int, initializer: Callable, initargs: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)
    initializer(*initargs)


@contextlib.contextmanager
def _ignoring_ctrl_c() -> Iterator[None]:
    """SIGINT ignored for the block: a process started in it inherits that (Python keeps an
    inherited SIG_IGN), so a Ctrl-C while a worker starts cannot print its traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stop(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Ends the workers now, whatever they are doing (Python >= 3.14 has this built in)."""
    terminate = getattr(pool, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.terminate()
    pool.shutdown(wait=True, cancel_futures=True)


def run_in_processes(task: Callable, tasks: Sequence[tuple], workers: int,
                     initializer: Callable, initargs: tuple,
                     show: Callable[..., None]) -> None:
    """Calls task(*t) for every t in `tasks` in `workers` spawned processes, each set up by
    `initializer(*initargs, progress_queue)`; `show(*item)` sees every item a worker puts on
    the queue while they run. A worker's exception is raised here, after the workers stop;
    so is a Ctrl-C (KeyboardInterrupt)."""
    context = multiprocessing.get_context("spawn")
    progress = context.Queue()
    pool = concurrent.futures.ProcessPoolExecutor(
        min(workers, len(tasks)), mp_context=context, initializer=_start_worker,
        initargs=(os.getpid(), initializer, (*initargs, progress)))
    try:
        with _ignoring_ctrl_c():  # the workers start now, and start with Ctrl-C ignored
            futures = [pool.submit(task, *t) for t in tasks]
        while not all(f.done() for f in futures):
            try:
                show(*progress.get(timeout=0.2))
            except queue.Empty:
                pass
            for f in futures:
                if f.done() and f.exception() is not None:
                    raise f.exception()
    except BaseException:
        _stop(pool)
        raise
    pool.shutdown(wait=True)
    while not progress.empty():
        show(*progress.get())
