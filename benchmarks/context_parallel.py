"""Long context with context parallelism: per-device memory and step time of the tiny Step 3.5
and DeepSeek-V4 presets with each sequence split over `mesh.context` on host devices, against
the longest sequence one device can hold.

    python -m benchmarks.context_parallel [--part steps|layers] [--lengths 8192 32768 131072]
        [--context 8] [--families step35 deepseek_v4] [--budget-gib 8] [--steps 2]
        [--time-up-to 32768] [--layer-lengths 4096 16384]

Sets XLA_FLAGS=--xla_force_host_platform_device_count=CONTEXT itself (before JAX starts).
For each family and length T, one row of T tokens (three packed documents), the whole train
step as the trainer jits it (forward, backward, Muon/AdamW, router-bias update, monitors):
- memory: XLA's `compiled.memory_analysis()` per device, argument + output + temp - alias, on
  the `context` mesh and on one device (compiled only, nothing allocated);
- one device at every power of two from the shortest length up to the first that does not fit
  `--budget-gib`, and the longest that fits (that one also timed);
- time (T up to `--time-up-to`, the shared machine's patience): the median of `--steps` steps
  after one warm-up, and from a profile of one more step the share of the devices' time inside
  collective operations (all-gather, collective permute, all-reduce, all-to-all,
  reduce-scatter; on host devices that is mostly waiting at the rendezvous for the slowest
  device, plus the copies), and the collectives' bytes per device from the compiled HLO.
Results: benchmarks/results/context_parallel.json.

`--part layers` (benchmarks.context_parallel_layers): per attention layer kind, the cost of the
split beyond the tokens themselves, and the full-attention layer in both context layouts.
Results: benchmarks/results/context_parallel_layers.json.
"""

from __future__ import annotations

import argparse
import os
import sys


def _devices_flag(count: int) -> None:
    flag = f"--xla_force_host_platform_device_count={count}"
    if "jax" in sys.modules:
        raise SystemExit("benchmarks.context_parallel must set XLA_FLAGS before JAX starts")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["steps", "layers"], default="steps")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--layer-lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--context", type=int, default=8)
    parser.add_argument("--families", nargs="+", default=["step35", "deepseek_v4"],
                        choices=["step35", "deepseek_v4", "mimo"])
    parser.add_argument("--budget-gib", type=float, default=8.0,
                        help="one device's memory for the longest-sequence search (GiB)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--time-up-to", type=int, default=32768,
                        help="time the steps of lengths up to this (longer: memory only)")
    args = parser.parse_args(argv)
    lengths = args.lengths + args.layer_lengths
    if args.context < 2 or args.steps < 1 or any(t < 2 * args.context for t in lengths):
        parser.error("--context must be at least 2, --steps at least 1, and every length at "
                     "least twice the context")
    _devices_flag(args.context)
    if args.part == "layers":
        from benchmarks.context_parallel_layers import run_layers  # imports JAX
        run_layers(args)
    else:
        from benchmarks.context_parallel_run import run_benchmark  # imports JAX
        run_benchmark(args)


if __name__ == "__main__":
    main()
