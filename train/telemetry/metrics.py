"""Asynchronous metrics logging (report 3.3: logging must never stall training).

    with MetricsWriter(workdir) as writer:
        writer.write(step, metrics)   # returns at once; metrics may still be computing on device

A background thread fetches the values (`jax.device_get`) and writes
- `workdir/metrics.jsonl`: one JSON object per `write`, `{"step": int, name: float, ...}` for
  every scalar; non-finite values (NaN, ±inf) are written as `null` so every line is valid JSON;
  a string value (a generated sample) is written as it is;
- `workdir/tensorboard/`: TensorBoard scalars and texts, and a histogram for every array with
  more than one element (e.g. `moe_hist/...`; those never go to metrics.jsonl);
- every further sink given (`sinks`, e.g. Weights & Biases, train/telemetry/wandb_sink.py): the
  scalars of each record, `sink.log(step, scalars)`, and `sink.close()` at the end.
An exception in the thread is re-raised by the next `write`, `flush` or `close`.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import jax
import numpy as np

from model.interop.atomic_file import write_text_atomically

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
_FLUSH = object()  # queue item: flush the files
_STOP = object()  # queue item: close the files and end the thread


class ScalarSink(Protocol):
    """Somewhere else the scalars go (called from the writer's thread)."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _json_float(value: float) -> float | None:
    return value if math.isfinite(value) else None


def split_metrics(metrics: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Host values -> (scalars as python floats, arrays with more than one element)."""
    scalars, arrays = {}, {}
    for name, value in metrics.items():
        array = np.asarray(value)
        if array.size == 1:
            scalars[name] = float(array.reshape(()))
        elif array.size > 1:
            arrays[name] = array.astype(np.float64).reshape(-1)
    return scalars, arrays


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """metrics.jsonl -> list of records; an unparseable line (a write cut short by a crash) is
    skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


class MetricsWriter:
    """Non-blocking metrics sink: `metrics.jsonl` + TensorBoard under `workdir`.

    Only one process should write (e.g. `jax.process_index() == 0`). The queue is bounded
    (`max_pending` records) so a stalled disk eventually applies back-pressure instead of
    holding device buffers without limit.
    """

    def __init__(self, workdir: str | os.PathLike, *, tensorboard: bool = True,
                 max_pending: int = 1000, sinks: Sequence[ScalarSink] = ()):
        self.workdir = Path(workdir)
        self._sinks = tuple(sinks)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / METRICS_FILE
        self._tensorboard = tensorboard
        self._tb = None  # opened lazily by the thread, so truncate_after can set purge_step
        self._purge_step: int | None = None
        self._file = open(self.path, "a", encoding="utf-8")
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="MetricsWriter", daemon=True)
        self._thread.start()

    # ---- caller side ------------------------------------------------------------------------

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Enqueues one record; values may be jax arrays not yet computed."""
        self._raise_pending()
        if self._closed:
            raise RuntimeError("MetricsWriter.write after close()")
        self._queue.put((int(step), dict(metrics)))

    def flush(self) -> None:
        """Blocks until every record written so far is on disk."""
        if not self._closed:
            self._queue.put(_FLUSH)
            self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join()
        self._raise_pending()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def truncate_after(self, step: int) -> None:
        """Drops records with step > `step` (resuming from the checkpoint at `step`), so the file
        keeps one line per step. Atomic: a temporary file replaces metrics.jsonl. TensorBoard
        hides events after `step` too if this is called before the first `write`."""
        self.flush()
        if self._closed:
            raise RuntimeError("MetricsWriter.truncate_after after close()")
        if self._tb is None:
            self._purge_step = step + 1
        self._file.close()
        kept = [r for r in read_metrics(self.path) if r["step"] <= step]
        try:
            write_text_atomically(self.path, "".join(json.dumps(r, allow_nan=False) + "\n"
                                                     for r in kept))
        finally:
            self._file = open(self.path, "a", encoding="utf-8")

    def _raise_pending(self) -> None:
        error, self._error = self._error, None
        if isinstance(error, OSError):  # a full disk: the entry points report it in one line
            raise OSError(error.errno, f"writing {self.path} failed: {error.strerror}") from error
        if error is not None:
            raise RuntimeError(f"metrics writer failed: {error!r}") from error

    # ---- writer thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    self._close_files()
                    return
                if item is _FLUSH:
                    self._file.flush()
                    if self._tb is not None:
                        self._tb.flush()
                else:
                    self._write_record(*item)
            except BaseException as error:  # surfaced by the next call on the caller side
                if self._error is None:
                    self._error = error
            finally:
                self._queue.task_done()

    def _write_record(self, step: int, metrics: dict) -> None:
        texts = {k: v for k, v in metrics.items() if isinstance(v, str)}
        scalars, arrays = split_metrics(jax.device_get(
            {k: v for k, v in metrics.items() if k not in texts}))
        record = {"step": step, **{k: _json_float(v) for k, v in scalars.items()}, **texts}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        for sink in self._sinks:
            sink.log(step, scalars)
        if not self._tensorboard:
            return
        if self._tb is None:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(str(self.workdir / TENSORBOARD_DIR),
                                     purge_step=self._purge_step)
        for name, value in scalars.items():
            self._tb.add_scalar(name, value, step)
        for name, text in texts.items():
            self._tb.add_text(name, text, step)
        for name, values in arrays.items():
            finite = values[np.isfinite(values)]
            if finite.size:
                self._tb.add_histogram(name, finite, step)

    def _close_files(self) -> None:
        try:
            self._file.close()
        finally:
            if self._tb is not None:
                self._tb.close()
            for sink in self._sinks:
                sink.close()


class DiscardingWriter:
    """MetricsWriter's interface, writing nothing (processes other than the first)."""

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        del step, metrics

    def truncate_after(self, step: int) -> None:
        del step

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "DiscardingWriter":
        return self

    def __exit__(self, *exc) -> None:
        pass
