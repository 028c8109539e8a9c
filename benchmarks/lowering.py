"""Lowers the jitted train step and the decode step for TPU or CUDA on this (CPU) machine.

    python -m benchmarks.lowering --platform tpu --config configs/tiny.yaml \\
        model.attention_impl=pallas model.moe_impl=pallas
    python -m benchmarks.lowering --platform cuda --config configs/step35_flash.yaml \\
        --mesh data=64,expert=8,pipeline=8 --batch-size 1024 --seq-len 4096

JAX traces a function once and lowers it for any platform (`.trace(...).lower(
lowering_platforms=(...))`), so most lowering errors of a TPU or GPU program (a Pallas kernel
Mosaic or Triton cannot lower, a collective or custom call the platform lacks) show on a CPU
host without the hardware. Kernel choices made while tracing follow the platform named here
(`pallas_kernels.target`): splash attention and the Mosaic grouped matmuls for TPU, the Triton
kernels and cuDNN attention for CUDA (on an H100/H200 by default: `--gpu-capability` picks the
GPU, whose compute capability chooses between the Mosaic GPU and Triton attention). Nothing is
compiled or run, and nothing is allocated: state, batch and caches are abstract shapes.

What is lowered, per `--config` (several may be given; they share one JAX start-up):
- the train step (`train.step.make_train_step`, the optimizer update included) on a batch of
  train.batch_size x train.seq_len tokens; with `--mesh`, under an abstract device mesh of those
  sizes with the training's own shardings (no devices needed), so expert parallelism lowers its
  `ragged` all-to-all for the platform and the pipeline its stages;
- the decode step (`model.inference.decode.Decoder`: one token per row against the KV caches of
  `--decode-len` positions), on one device.
Printed: the custom calls found in each lowered module, by kernel family (Mosaic for TPU,
Triton, Mosaic GPU and cuDNN for GPU) with their kernel names, and the explicit collectives
(those inside shard_map; XLA adds the sharding collectives later, when it compiles).

Lowering is not compiling: Mosaic's and Triton's own compilers (libtpu, ptxas) and the device
run are not exercised. Exit codes: 0 every lowering succeeded, 1 one failed (one line each on
stderr), 2 bad flags or config.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import re
import sys
import time
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config.cli import ArgumentParser, format_table, report_error
from model.config.model_config import INT32_MAX
from model.inference.decode import Decoder
from model.inference.sampling import Sampling
from model.lm import abstract_variables
from model.parallel.rules import LOGICAL_RULES, abstract_mesh, named
from pallas_kernels.target import lowering_for
from train.config import RunConfig, load_run_config
from train.parallel.plan import parse_mesh, resolve_mesh
from train.parallel.sharding import batch_spec, check_batch_fits, state_specs
from train.state import abstract_state, build_training
from train.step import make_train_step

PLATFORMS = ("tpu", "cuda")
# custom-call target (prefix) -> kernel family
KERNEL_FAMILIES = (
    ("tpu_custom_call", "Mosaic (TPU)"),
    ("__gpu$xla.gpu.triton", "Triton (GPU)"),
    ("mosaic_gpu", "Mosaic GPU"),
    ("__cudnn$", "cuDNN"),
)
COLLECTIVES = ("ragged_all_to_all", "all_to_all", "all_gather", "all_reduce", "reduce_scatter",
               "collective_permute")
_CUSTOM_CALL = re.compile(r"custom_call @([\w$.]+)\((.*)$", re.M)
_KERNEL_NAME = re.compile(r'(?:kernel_name = |\\22name\\22: \\22|name = )"?([\w.$-]+)')


def kernel_calls(text: str) -> dict[str, collections.Counter]:
    """{family: Counter(kernel name)} of the custom calls in lowered StableHLO `text` (one entry
    per call site in the module; a kernel inside a loop body counts once)."""
    found: dict[str, collections.Counter] = {}
    for match in _CUSTOM_CALL.finditer(text):
        target, rest = match.groups()
        family = next((name for prefix, name in KERNEL_FAMILIES if target.startswith(prefix)),
                      None)
        if family is None:
            continue
        name = _KERNEL_NAME.search(rest)
        found.setdefault(family, collections.Counter())[name.group(1) if name else target] += 1
    return found


def collectives(text: str) -> dict[str, int]:
    counts = {op: len(re.findall(rf"stablehlo\.{op}\b|custom_call @{op}\b", text))
              for op in COLLECTIVES}
    return {op: n for op, n in counts.items() if n}


def _abstract_batch(run: RunConfig, sharding=None) -> dict:
    """[accumulation steps, micro-batch, T] of the packed-document features."""
    micro = run.train.micro_batch()
    shape = (run.train.batch_size // micro, micro, run.train.seq_len)
    dtypes = {"tokens": jnp.int32, "segment_ids": jnp.int32, "positions": jnp.int32,
              "meta_mask": jnp.bool_}
    return {k: jax.ShapeDtypeStruct(shape, d, sharding=sharding) for k, d in dtypes.items()}


def lower_train_step(run: RunConfig, platform: str, sizes: dict[str, int] | None) -> str:
    training = build_training(run)
    state, batch = abstract_state(training, run.train.seed), _abstract_batch(run)
    context = contextlib.nullcontext()
    if sizes is not None:
        mesh = abstract_mesh(sizes)
        shardings = named(mesh, state_specs(state, training.variable_axes, mesh, run))
        state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                             state, shardings)
        batch = _abstract_batch(run, jax.sharding.NamedSharding(mesh, batch_spec(mesh)))
        # what `use_mesh` sets up for the model while tracing, on a mesh without devices
        context = abstract_mesh_context(mesh)
    with context:
        traced = jax.jit(make_train_step(training, run)).trace(
            state, batch, jax.ShapeDtypeStruct((), jnp.bool_))
        return traced.lower(lowering_platforms=(platform,)).as_text()


@contextlib.contextmanager
def abstract_mesh_context(mesh):
    """The mesh and logical-axis rules as the model reads them while tracing (what
    `model.parallel.rules.use_mesh` sets up), for a mesh without devices."""
    with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(LOGICAL_RULES):
        yield


def lower_decode_step(run: RunConfig, platform: str, max_len: int) -> str:
    variables = nn.meta.unbox(abstract_variables(run.model))
    decoder = Decoder(run.model, variables, max_len=max_len)
    rows = run.train.micro_batch()
    cache = jax.eval_shape(functools.partial(decoder._init_cache, batch=rows), variables)
    token = jax.ShapeDtypeStruct((rows,), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    traced = decoder._decode.trace(variables, cache, token, token, key, Sampling())
    return traced.lower(lowering_platforms=(platform,)).as_text()


def summarize(text: str) -> dict:
    return {"kernels": {family: dict(counter) for family, counter in kernel_calls(text).items()},
            "collectives": collectives(text), "module_chars": len(text)}


def load_run(path: str, overrides: list[str], mesh_text: str | None
             ) -> tuple[RunConfig, dict[str, int] | None]:
    """(run config, mesh sizes or None); ValueError on a bad config, mesh or batch split."""
    if mesh_text is None:
        return load_run_config(path, overrides), None
    mesh = [f"mesh.{a}={s}" for a, s in parse_mesh(mesh_text).items()]
    run = load_run_config(path, [*overrides, *mesh])
    sizes = resolve_mesh(run, None)
    check_batch_fits(run, abstract_mesh(sizes))
    return run, sizes


def lower_config(run: RunConfig, sizes: dict[str, int] | None, platform: str,
                 capability: tuple[int, int] | None, decode_len: int) -> dict:
    """Lowers both steps of one config; a failed lowering is recorded as its error line."""
    steps = {"train step": lambda: lower_train_step(run, platform, sizes),
             "decode step": lambda: lower_decode_step(run, platform, decode_len)}
    results = {}
    with lowering_for(platform, capability):
        for name, lower in steps.items():
            start = time.perf_counter()
            try:
                results[name] = summarize(lower())
            except Exception as err:  # noqa: BLE001 - reported as one line, exit code 1
                results[name] = {"error": f"{type(err).__name__}: {' '.join(str(err).split())}"}
            results[name]["seconds"] = round(time.perf_counter() - start, 2)
    return results


def render(report: dict) -> str:
    gpu = report["gpu_capability"]
    target = report["platform"] + (f" (compute capability {gpu[0]}.{gpu[1]})" if gpu else "")
    lines = [f"lowered for {target} on a {jax.default_backend()} host (jax {jax.__version__}); "
             "nothing compiled or run"]
    for config, steps in report["configs"].items():
        for step, result in steps.items():
            lines.append("")
            head = f"{config}: {step} ({result['seconds']:.1f} s)"
            if "error" in result:
                lines.append(f"{head}: FAILED: {result['error'][:500]}")
                continue
            rows = [[name, family, str(count)] for family, names in result["kernels"].items()
                    for name, count in sorted(names.items())]
            lines.append(f"{head}: lowered, {result['module_chars']:,} characters of StableHLO")
            lines.append(format_table(["kernel", "family", "calls"], rows) if rows
                         else "no custom kernels (XLA's own ops only)")
            if result["collectives"]:
                lines.append("explicit collectives: " + ", ".join(
                    f"{op} x{n}" for op, n in result["collectives"].items()))
    return "\n".join(lines)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m benchmarks.lowering", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--platform", required=True, choices=PLATFORMS,
                        help="the platform to lower for")
    parser.add_argument("--config", required=True, action="append", metavar="PATH",
                        help="run YAML or model preset; repeat for several")
    parser.add_argument("--gpu-capability", default="9.0", metavar="MAJOR.MINOR",
                        help="cuda: the compute capability lowered for; kernel families follow "
                             "it (default 9.0, an H100/H200: Mosaic GPU attention where it "
                             "applies; 8.0, an A100: Triton)")
    parser.add_argument("--mesh", metavar="AXIS=N,...",
                        help="lower the train step under an abstract mesh of these sizes, e.g. "
                             "data=8,expert=8,pipeline=2 (default: one device)")
    parser.add_argument("--batch-size", type=int, metavar="N", help="train.batch_size")
    parser.add_argument("--seq-len", type=int, metavar="N", help="train.seq_len")
    parser.add_argument("--decode-len", type=int, default=256, metavar="N",
                        help="KV-cache positions of the decode step (default: 256)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides for every config, e.g. model.attention_impl=pallas")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_intermixed_args(argv)
    except SystemExit as exit_:  # argparse errors (one line, code 2) and --help (0)
        return int(exit_.code or 0)
    overrides = list(args.overrides)
    for flag, key in (("batch_size", "train.batch_size"), ("seq_len", "train.seq_len")):
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    if not 1 <= args.decode_len <= INT32_MAX:  # positions are int32
        return report_error(ValueError(f"--decode-len: must be in [1, {INT32_MAX}] (positions "
                                       f"are int32), got {args.decode_len}"))
    major, dot, minor = args.gpu_capability.partition(".")
    if not (major.isdigit() and dot and minor.isdigit()):
        return report_error(ValueError(f"--gpu-capability: expected MAJOR.MINOR such as 9.0, "
                                       f"got {args.gpu_capability!r}"))
    capability = (int(major), int(minor)) if args.platform == "cuda" else None
    try:  # every config and the mesh are checked before anything is traced
        runs = {path: load_run(path, overrides, args.mesh) for path in args.config}
    except ValueError as err:
        return report_error(err)
    report = {"platform": args.platform, "gpu_capability": capability, "configs": {
        path: lower_config(run, sizes, args.platform, capability, args.decode_len)
        for path, (run, sizes) in runs.items()}}
    print(json.dumps(report, indent=2) if args.json else render(report))
    failed = [(c, s, r["error"]) for c, steps in report["configs"].items()
              for s, r in steps.items() if "error" in r]
    for config, step, error in failed:
        print(f"error: lowering the {step} of {config} for {args.platform} failed: "
              f"{error[:300]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
