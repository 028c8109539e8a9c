"""SIGINT/SIGTERM during a run: the first asks the loop to save a checkpoint and stop after the
current step, and says so at once; the second exits at once (status 128 + signal, 130 for
Ctrl-C).

    with stop_requests() as stop:
        while ...:
            if stop["signal"] is not None: save and leave

A Python signal handler only runs when the main thread is back in Python, not during a long call
into XLA (the first compile can take minutes), which is why neither the acknowledgement nor a
second Ctrl-C used to get through. Here the interpreter's wakeup fd (`signal.set_wakeup_fd`)
wakes a watcher thread instead, which runs while the main thread is in C++. A forced exit
abandons an asynchronous save in flight: orbax writes into a temporary directory and renames it
when complete, so the checkpoints saved before stay intact and the next run resumes from the
last complete one.
"""

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_requests() -> Iterator[dict]:
    """Yields {"signal": None, or the name of the first stop signal received}; call from the
    main thread."""
    requested = {"signal": None}
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # the interpreter's C handler writes here

    def handler(signum, _frame) -> None:  # main thread, between bytecodes: what the loop polls
        if requested["signal"] is None:
            requested["signal"] = signal.Signals(signum).name

    def watch() -> None:  # woken at once, wherever the main thread is
        received = 0
        while data := os.read(read_end, 1):  # b"": the block ended and closed the pipe
            if data[0] not in STOP_SIGNALS:
                continue
            name, received = signal.Signals(data[0]).name, received + 1
            if received > 1:
                print(f"received {name} again: exiting now, without saving", file=sys.stderr,
                      flush=True)
                os._exit(128 + data[0])
            requested["signal"] = requested["signal"] or name
            print(f"received {name}: will save a checkpoint and stop after the current step; "
                  "press Ctrl-C again to exit now", file=sys.stderr, flush=True)

    # With a Python handler installed, the interpreter also writes each signal to the wakeup fd.
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    previous_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="stop_requests", daemon=True)
    watcher.start()
    try:
        yield requested
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(previous_wakeup)
        os.close(write_end)
        watcher.join()
        os.close(read_end)
