"""Shared benchmark helpers: timing, compiled memory, machine description, result files."""

import json
import os
import platform
import statistics
import time
from pathlib import Path

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
