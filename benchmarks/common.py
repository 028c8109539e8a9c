"""Shared benchmark helpers: timing, compiled memory, machine description, result files."""

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import jax

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
        "jax": jax.__version__,
        "python": platform.python_version(),
    }


def time_compiled(compiled, *args, repeats: int = 5) -> float:
    """Median wall seconds of `compiled(*args)` after one warm-up call."""
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(steps: dict[str, Callable[[], object]], rounds: int,
                settle: int = 0) -> dict[str, float]:
    """Median seconds of each closure of `interleaved_times`."""
    return {name: statistics.median(t)
            for name, t in interleaved_times(steps, rounds, settle).items()}


def interleaved_times(steps: dict[str, Callable[[], object]], rounds: int,
                      settle: int = 0) -> dict[str, list[float]]:
    """Seconds of each closure, called once per round in turn (after one warm-up call), so
    that a slow patch of the shared machine hits every side alike. `settle` untimed calls
    precede each timed one: for sides with their own allocators (JAX and torch in one process),
    whose first call after the other side's reuses memory the other just freed and pays its page
    faults again (measured at the medium vs_torch size: a JAX step right after a torch step took
    8-9 s, the next one 5.7 s)."""
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            for _ in range(settle):
                step()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return times


def temp_bytes(compiled) -> int | None:
    """XLA's planned temporary buffer size of a compiled function (its peak scratch memory)."""
    analysis = compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    return path


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
