"""Our Mosaic grouped matmul (`pallas_kernels.grouped_matmul.gmm`) against JAX's megablox `gmm`
(`jax.experimental.pallas.ops.tpu.megablox`), both differentiable, on a CPU host.

    python -m benchmarks.megablox_compare [--json]

Per case (float32, Pallas interpret mode, tiles 16 x 32 x 32): the forward and both gradients
(dlhs, drhs) against float64 numpy loops, as the largest error relative to the reference's
largest magnitude, or the exception the kernel raised. The cases are the shapes the model's MoE
hands the kernel: rows exactly filling whole tiles, rows past the last group (dropped routed
copies, the unused rows of expert parallelism's receive buffer, which must come out 0), a row
count off the row tile, K and N off their tiles, and empty groups. Then whether each lowers to
Mosaic for TPU (bfloat16, 128-wide tiles, forward and backward; `lowering_platforms=("tpu",)`,
nothing compiled) and the lines of code of each. No timings: interpret mode on a CPU says
nothing about a TPU.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox_ops

from benchmarks.common import machine
from model.config.cli import format_table
from pallas_kernels import grouped_matmul
from pallas_kernels.target import lowering_for

TILES = (16, 32, 32)
# name -> (rows M, contract K, cols N, group sizes)
CASES = {
    "aligned": (64, 64, 64, (16, 32, 0, 16)),
    "rows past the groups": (64, 64, 64, (10, 20, 0, 6)),
    "M off the row tile": (60, 64, 64, (13, 27, 0, 20)),
    "K, N off their tiles": (64, 40, 72, (16, 32, 0, 16)),
    "empty groups": (64, 64, 64, (0, 64, 0, 0)),
}


def reference(lhs, rhs, sizes):
    """float64 loops: out[r] = lhs[r] @ rhs[g(r)] for rows in groups, 0 past them."""
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = lhs[start:start + size] @ rhs[g]
        start += size
    return out


def ours(lhs, rhs, sizes, interpret=True):
    return grouped_matmul.gmm(lhs, rhs, sizes, tiling=TILES if interpret else (128, 128, 128),
                              interpret=interpret, kernel="mosaic")


def megablox(lhs, rhs, sizes, interpret=True):
    return megablox_ops.gmm(lhs, rhs, sizes, jnp.float32 if interpret else lhs.dtype,
                            TILES if interpret else (128, 128, 128), None, None, False,
                            interpret)


KERNELS = {"ours": ours, "megablox": megablox}


def check(kernel, case) -> dict:
    m, k, n, sizes = case
    rng = np.random.default_rng(0)
    lhs, rhs = rng.normal(size=(m, k)), rng.normal(size=(len(sizes), k, n))
    cotangent = rng.normal(size=(m, n))
    in_groups = np.arange(m) < sum(sizes)
    want = reference(lhs, rhs, sizes)
    # d/dlhs and d/drhs of sum(out * cotangent), by hand from the reference's definition
    want_dlhs = np.zeros_like(lhs)
    want_drhs = np.zeros_like(rhs)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        want_dlhs[rows] = cotangent[rows] @ rhs[g].T
        want_drhs[g] = lhs[rows].T @ cotangent[rows]
        start += size
    args = (jnp.asarray(lhs, jnp.float32), jnp.asarray(rhs, jnp.float32),
            jnp.asarray(sizes, jnp.int32))

    @jax.jit
    def run(lhs, rhs, sizes):
        out, vjp = jax.vjp(lambda a, b: kernel(a, b, sizes), lhs, rhs)
        return (out, *vjp(jnp.asarray(cotangent, jnp.float32)))

    try:
        out, dlhs, drhs = jax.block_until_ready(run(*args))
    except Exception as err:  # noqa: BLE001 - recorded as the case's result
        return {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"}

    def error(got, expected, rows=None):
        got = np.asarray(got, np.float64)
        if rows is not None:
            got, expected = got[rows], expected[rows]
        return float(np.max(np.abs(got - expected)) / max(np.max(np.abs(expected)), 1e-30))

    return {"out": error(out, want), "out_in_groups": error(out, want, in_groups),
            "dlhs": error(dlhs, want_dlhs), "drhs": error(drhs, want_drhs)}


def lowers_for_tpu(kernel) -> str:
    """'yes (N Mosaic calls)' or the error: forward + backward at 1024 x 512 x 512, 8 groups."""
    lhs = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((8, 512, 512), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)

    def loss(lhs, rhs, sizes):
        return jnp.sum(kernel(lhs, rhs, sizes, interpret=False).astype(jnp.float32) ** 2)

    try:
        with lowering_for("tpu"):
            text = jax.jit(jax.value_and_grad(loss, (0, 1))).trace(lhs, rhs, sizes).lower(
                lowering_platforms=("tpu",)).as_text()
    except Exception as err:  # noqa: BLE001
        return f"no: {type(err).__name__}: {' '.join(str(err).split())[:120]}"
    return f"yes ({text.count('custom_call @tpu_custom_call')} Mosaic calls)"


def code_lines() -> dict:
    """Lines of the modules (ours: the Mosaic kernels and the schedule they share with the
    Triton kernels; megablox: its package less `__init__`)."""
    def lines(*modules):
        return sum(len(inspect.getsource(importlib.import_module(m)).splitlines())
                   for m in modules)
    package = "jax.experimental.pallas.ops.tpu.megablox"
    return {"ours": lines("pallas_kernels.grouped_matmul", "pallas_kernels.grouped_common"),
            "megablox": lines(*(f"{package}.{m}" for m in ("gmm", "ops", "common")))}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.megablox_compare",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    results = {name: {case: check(kernel, shape) for case, shape in CASES.items()}
               for name, kernel in KERNELS.items()}
    report = {"machine": machine(), "tiles": TILES, "cases": results,
              "lowers_for_tpu": {name: lowers_for_tpu(k) for name, k in KERNELS.items()},
              "lines_of_code": code_lines()}
    if args.json:
        print(json.dumps(report, indent=2))
        return

    def cell(result):
        if "error" in result:
            return result["error"]
        errors = "/".join(f"{result[k]:.0e}" for k in ("out", "dlhs", "drhs"))
        if result["out_in_groups"] != result["out"]:
            errors += f" (in the groups {result['out_in_groups']:.0e})"
        return errors

    rows = [[case, *(cell(results[name][case]) for name in KERNELS)] for case in CASES]
    rows.append(["lowers for TPU", *report["lowers_for_tpu"].values()])
    rows.append(["lines of code", *(str(v) for v in report["lines_of_code"].values())])
    print(f"largest error of out / dlhs / drhs relative to float64 loops, interpret mode "
          f"(jax {jax.__version__}, {jax.default_backend()} host)")
    print(format_table(["case", *KERNELS], rows))


if __name__ == "__main__":
    main()
