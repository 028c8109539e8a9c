"""A first run of the Mosaic GPU grouped matmuls in a child process, before `make gpu-check`
relies on them (as benchmarks/gpu/mosaic_probe.py does for the flash attention): upstream's
kernels have never run under stepjax, its own GPU test of the transposed ragged dot (the weight
gradient) is skipped as broken, and a kernel that hangs would stall the suite past its lease.

The child runs each leg (fwd, dx with transpose_rhs, dw) once on bfloat16 operands with an empty
group and rows past the groups, against `lax.ragged_dot` with float32 accumulation, and prints
each leg's relative error or exception. A leg that fails, is wrong or does not finish within the
timeout is taken out for the rest of the run (`grouped_leg_table.UNAVAILABLE`): the rule and
the sweep use other kernels for it, and the report's header says why. The child starts
alongside the flash-attention probe (`start`), and `finish` collects it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.gpu.checks import TOLERANCE
from benchmarks.gpu.mosaic_probe import REPO, _error_line
from pallas_kernels import grouped_leg_table

CHILD = """
import json
import jax.numpy as jnp, numpy as np
from benchmarks.gpu.moe_legs import leg_call, operands, relative_error
from pallas_kernels.grouped_legs import LegChoice
for leg in ("fwd", "dx", "dw"):
    try:
        lhs, rhs, sizes = operands(leg, 3000, 256, 384, 6, jnp.bfloat16, 0)
        sizes = jnp.asarray([900, 0, 700, 500, 400, 300], jnp.int32)  # rows 2800.. in none
        want = leg_call(leg, LegChoice("xla"))(lhs, rhs, sizes)
        got = leg_call(leg, LegChoice("mosaic_gpu"))(lhs, rhs, sizes)
        result = {"error": relative_error(got, want)}
    except Exception as err:
        result = {"exception": f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]}
    print("PROBE " + json.dumps({leg: result}), flush=True)
"""


def start() -> subprocess.Popen:
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",  # the parent holds memory
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def verdicts(stdout: str) -> dict[str, str | None]:
    """leg -> None if it ran and is right, else why not, from the child's PROBE lines."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith("PROBE "):
            found.update(json.loads(line[len("PROBE "):]))
    out = {}
    for leg in ("fwd", "dx", "dw"):
        result = found.get(leg)
        if result is None:
            out[leg] = "did not finish"
        elif "exception" in result:
            out[leg] = result["exception"]
        elif not result["error"] <= TOLERANCE["bfloat16"]:
            out[leg] = f"relative error {result['error']:.2e} over {TOLERANCE['bfloat16']:g}"
        else:
            out[leg] = None
    return out


def finish(child: subprocess.Popen, timeout_s: float = 150.0) -> str:
    """Waits for the child, takes failed legs out (`grouped_leg_table.UNAVAILABLE`) and says
    what happened in one line."""
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
        ending = "" if child.returncode == 0 else f" (exit {child.returncode}: " \
            f"{_error_line(stderr)})"
    except subprocess.TimeoutExpired:
        child.kill()
        stdout, _ = child.communicate()
        ending = f" (killed after {timeout_s:.0f} s: a hang?)"
    results = verdicts(stdout)
    for leg, problem in results.items():
        if problem:
            grouped_leg_table.UNAVAILABLE[("mosaic_gpu", leg)] = f"probe: {problem}"
    return "; ".join(f"{leg} {problem or 'ok'}" for leg, problem in results.items()) + ending
