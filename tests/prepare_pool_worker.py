"""Run by tests/train/test_prepare_faults.py in a subprocess: `python prepare_pool_worker.py DIR`
starts two workers of `python -m train.data.prepare`'s pool (train/data/prepare_pool.py) on
tasks that note their pid in DIR and then sleep, so the test can interrupt or kill this process
while they work. Exits 130 on Ctrl-C, as prepare does."""

import os
import sys
import time
from pathlib import Path

from train.data.prepare_pool import run_in_processes

_notes: dict = {}


def note_to(directory: str, progress) -> None:
    _notes["directory"] = directory


def work(number: int) -> None:
    Path(_notes["directory"], f"{os.getpid()}.pid").write_text(str(number))
    time.sleep(600)


if __name__ == "__main__":
    try:
        run_in_processes(work, [(0,), (1,)], 2, note_to, (sys.argv[1],), show=print)
    except KeyboardInterrupt:
        sys.exit(130)
