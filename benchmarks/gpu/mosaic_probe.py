"""A first run of the Mosaic GPU flash attention in a child process, before `make gpu-check`
relies on it: the kernels have never run on a device before their first suite run, and a
kernel that hangs (a barrier never completes) would stall the whole suite past its lease with
no report. The child runs forward + backward of one small case with every feature (window,
segment ids, sink, GQA; bfloat16) against the suite's reference, within a timeout. If it
hangs, fails or is wrong, `pallas_kernels.attention.UNAVAILABLE` takes the Mosaic family out
for the rest of the run (`attention_impl=pallas` runs the Triton kernel) and the report says
why.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu.checks import TOLERANCE

REPO = Path(__file__).resolve().parents[2]
CHILD = """
import json
from benchmarks.gpu.checks import (AttentionCase, attention_inputs, attention_outputs,
                                   reference_attention, relative_errors)
from pallas_kernels.attention import mosaic_attention
case = AttentionCase("probe", 1, 384, 4, 2, 128, 100, True, True, "bfloat16")
inputs = attention_inputs(case)
want, _ = attention_outputs(reference_attention, case, inputs)
got, _ = attention_outputs(mosaic_attention, case, inputs)
print("PROBE " + json.dumps(relative_errors(got, want)))
"""


def _error_line(stderr: str) -> str:
    """The exception line of a traceback (the last line naming an Error or Exception), else
    the last line."""
    lines = stderr.strip().splitlines() or ["no output"]
    named = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b", line)]
    return (named or lines)[-1][:300]


def probe_mosaic(timeout_s: float = 150.0) -> tuple[bool, str]:
    """(usable, what happened) of the Mosaic GPU flash attention on this device."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",  # the parent holds memory
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        result = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"a 384-token probe did not finish in {timeout_s:.0f} s (a hang?)"
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    if result.returncode or not lines:
        return False, f"the probe failed (exit {result.returncode}): {_error_line(result.stderr)}"
    errors = json.loads(lines[-1][len("PROBE "):])
    worst = max(errors, key=errors.get)
    summary = f"probe worst error {worst} {errors[worst]:.2e}"
    if not errors[worst] <= TOLERANCE["bfloat16"]:
        return False, f"{summary} over the bfloat16 tolerance {TOLERANCE['bfloat16']:g}"
    return True, summary
