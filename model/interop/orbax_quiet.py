"""Orbax's background failures, reported once.

When an asynchronous save or a restore fails (a full disk, a corrupt file), orbax's worker
threads log the failure themselves (absl ERROR records with a traceback per array, asyncio's
"exception was never retrieved" for each write task), and TensorStore callbacks completing into
orbax's closed event loop print "Event loop is closed" tracebacks: about a thousand lines for
one full disk. The same failure reaches the main thread as the exception of the save or the
restore, which `Checkpointer` turns into one line, so these copies are dropped. Other absl
records and other unraisable exceptions pass untouched.
"""

from __future__ import annotations

import logging
import sys

_ORBAX_SOURCE = "/orbax/"


def quiet_background_failures() -> None:
    """Installs the filters once per process (idempotent)."""
    if getattr(sys.unraisablehook, "drops_closed_loop_callbacks", False):
        return
    logging.getLogger("absl").addFilter(_not_an_orbax_error)
    logging.getLogger("asyncio").addFilter(_not_an_unretrieved_task)
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not (isinstance(unraisable.exc_value, RuntimeError)
                and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    hook.drops_closed_loop_callbacks = True
    sys.unraisablehook = hook


def _not_an_orbax_error(record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and _ORBAX_SOURCE in record.pathname)


def _not_an_unretrieved_task(record: logging.LogRecord) -> bool:
    """asyncio logs each failed task or future nobody awaited when it is garbage-collected.
    stepjax runs no asyncio code of its own: in a process holding a Checkpointer these are
    orbax's and TensorStore's writes, whose traceback may not even pass through orbax."""
    return "exception was never retrieved" not in record.getMessage()
