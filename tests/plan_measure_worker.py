"""Runs in a subprocess with 8 CPU devices (tests/train/test_plan_measure.py): `python -m
train.plan --measure --json` of the tiny preset at d_model 256 on each mesh given, compiled
with XLA:CPU's memory-minimising scheduler (the test sets the flag). Prints one JSON object {case: {"code",
"total" (the estimate), "measured" (XLA's figures), "pipeline" (the plan's pipeline facts or
null)}}.

    XLA_FLAGS="--xla_force_host_platform_device_count=8 ..." python tests/plan_measure_worker.py \
        CASE...

CASE: a mesh (`pipeline=2,data=4`), optionally followed by `:` and space-separated overrides
(`data=8:model.remat_policy=full`).
"""

import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.parallel.plan import main  # noqa: E402

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
# The comparison's run: the tiny preset at d_model 256 under `dots`, 16 sequences of 1,024
# tokens (2,048 tokens per device on 8 devices). Not cut to fewer layers: with one or two
# layers per segment the working set of the layer being differentiated outweighs what the
# layers keep, and the estimate, which counts both in full, overshoots (docs/parallelism.md).
RUN = ["model.d_model=256", "model.remat_policy=dots", "--batch-size", "16", "--seq-len", "1024"]


def measure(case: str) -> dict:
    mesh, _, overrides = case.partition(":")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["--config", TINY, "--mesh", mesh, "--measure", "--json", *RUN,
                     *overrides.split()])
    plan = json.loads(out.getvalue())
    return {"code": code, "total": plan["per_device_bytes"]["total"],
            "measured": plan["measured"], "pipeline": plan["pipeline"]}


if __name__ == "__main__":
    print(json.dumps({case: measure(case) for case in sys.argv[1:]}))
