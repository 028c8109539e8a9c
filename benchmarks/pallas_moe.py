"""Pallas grouped matmul (`moe_impl=pallas`): throughput on TPU, tile-schedule sizes everywhere.

    python -m benchmarks.pallas_moe [--tokens 8192] [--top-k 8] [--experts 288]
        [--d-model 4096] [--expert-hidden 1280] [--dtype bfloat16] [--tiling 128 512 512]
        [--peak-tflops T --peak-gbps B]

TPU: times gmm forward ([M, D] x [E, D, F], the gate/up projection shape) and backward (dlhs +
drhs), and prints TFLOP/s and achieved bandwidth (compulsory bytes / time, a lower bound on the
real traffic) against the device's peak. GPU: the kernels target TPU only, so the same metrics
are reported for `jax.lax.ragged_dot` (the GPU `moe_impl`), labelled as such. CPU: Pallas runs
in interpret mode, whose time is not a performance figure; only the static tile schedule (grid
steps per row tile) is reported, for several routing skews.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import markdown_table, save, time_compiled
from pallas_kernels.grouped_matmul import Tiling, gmm, make_schedule, schedule_size

# Dense bf16 matmul peak (TFLOP/s) and HBM bandwidth (GB/s) per JAX device, from vendor spec
# sheets; matched by substring of `device_kind`, first match wins. Override with --peak-*.
PEAKS = [
    ("TPU v6 lite", 918.0, 1640.0),  # v6e (Trillium)
    ("TPU v5 lite", 197.0, 819.0),  # v5e
    ("TPU v5", 459.0, 2765.0),  # v5p
    ("TPU v4", 275.0, 1228.0),
    ("H200", 989.0, 4800.0),
    ("H100 PCIe", 756.0, 2000.0),
    ("H100", 989.0, 3350.0),  # SXM
    ("A100-SXM4-40GB", 312.0, 1555.0),
    ("A100", 312.0, 2039.0),  # 80GB
    ("B200", 2250.0, 8000.0),
]

SKEWS = ["uniform", "zipf", "hot-50%", "one-expert"]


def routing_group_sizes(skew: str, num_rows: int, num_experts: int, seed: int = 0) -> np.ndarray:
    """Rows per expert for a routing skew (top-k copies drawn independently per row)."""
    rng = np.random.default_rng(seed)
    if skew == "uniform":
        probs = np.full(num_experts, 1.0 / num_experts)
    elif skew == "zipf":  # p_e proportional to 1 / (e + 1)
        probs = 1.0 / np.arange(1, num_experts + 1)
        probs /= probs.sum()
    elif skew == "hot-50%":  # half the rows to expert 0, the rest uniform
        probs = np.full(num_experts, 0.5 / (num_experts - 1))
        probs[0] = 0.5
    elif skew == "one-expert":
        probs = np.eye(num_experts)[0]
    else:
        raise ValueError(f"unknown skew {skew!r} (choose from {SKEWS})")
    return rng.multinomial(num_rows, probs).astype(np.int32)


def schedule_report(num_rows: int, num_experts: int, tm: int) -> list[dict]:
    tiles = -(-num_rows // tm)
    records = []
    for skew in SKEWS:
        sizes = jnp.asarray(routing_group_sizes(skew, num_rows, num_experts))
        gmm_visits = int(make_schedule(sizes, num_rows, tm, visit_empty_groups=False).num_visits)
        tgmm_visits = int(make_schedule(sizes, num_rows, tm, visit_empty_groups=True).num_visits)
        records.append({
            "skew": skew, "rows": num_rows, "row_tile": tm, "row_tiles": tiles,
            "schedule_size": schedule_size(num_rows, tm, num_experts),
            "gmm_visits": gmm_visits, "tgmm_visits": tgmm_visits,
            "empty_experts": int(jnp.sum(sizes == 0)), "max_expert_rows": int(jnp.max(sizes)),
        })
    return records


def device_peak(args) -> tuple[float | None, float | None, str]:
    kind = jax.devices()[0].device_kind
    tflops, gbps = None, None
    for name, t, b in PEAKS:
        if name in kind:
            tflops, gbps = t, b
            break
    return args.peak_tflops or tflops, args.peak_gbps or gbps, kind


def time_matmuls(args, backend: str) -> list[dict]:
    m, d, f, e = args.tokens * args.top_k, args.d_model, args.expert_hidden, args.experts
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(keys[0], (m, d), dtype)
    rhs = (jax.random.normal(keys[1], (e, d, f), jnp.float32) * d**-0.5).astype(dtype)
    dout = jax.random.normal(keys[2], (m, f), dtype)
    sizes = jnp.asarray(routing_group_sizes(args.skew, m, e))
    if backend == "tpu":
        name = "pallas gmm"
        matmul = lambda a, b: gmm(a, b, sizes, tiling=Tiling(*args.tiling), interpret=False)
    else:
        name = "ragged_dot (XLA; the Pallas kernels are TPU-only)"
        matmul = lambda a, b: jax.lax.ragged_dot(a, b, sizes)
    forward = jax.jit(matmul)
    backward = jax.jit(lambda a, b, g: jax.vjp(matmul, a, b)[1](g))

    size = dtype.itemsize
    cases = [
        ("forward", forward, (lhs, rhs), 2 * m * d * f, size * (m * d + e * d * f + m * f)),
        # dlhs = dout @ W^T reads dout, W, writes dlhs; drhs reads lhs, dout, writes dW
        ("backward", backward, (lhs, rhs, dout), 4 * m * d * f,
         size * (m * f + e * d * f + m * d) + size * (m * d + m * f + e * d * f)),
    ]
    peak_tflops, peak_gbps, kind = device_peak(args)
    records = []
    for label, fn, fn_args, flops, nbytes in cases:
        seconds = time_compiled(fn, *fn_args, repeats=args.repeats)
        record = {"impl": name, "pass": label, "device": kind, "seconds": seconds,
                  "tflops": flops / seconds / 1e12, "gbps": nbytes / seconds / 1e9}
        if peak_tflops:
            record["tflops_of_peak"] = record["tflops"] / peak_tflops
        if peak_gbps:
            record["gbps_of_peak"] = record["gbps"] / peak_gbps
        records.append(record)
    if not (peak_tflops and peak_gbps):
        print(f"peak of {kind!r} unknown: pass --peak-tflops / --peak-gbps for the % columns")
    if dtype != jnp.bfloat16:
        print(f"note: the peak table is for bfloat16 matmuls; this run uses {dtype.name}")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=288)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--expert-hidden", type=int, default=1280)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tiling", type=int, nargs=3, default=[128, 512, 512],
                        metavar=("ROWS", "CONTRACT", "COLS"), help="gmm tiles (TPU)")
    parser.add_argument("--skew", default="uniform", choices=SKEWS,
                        help="routing of the timed run")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, help="device matmul peak, TFLOP/s")
    parser.add_argument("--peak-gbps", type=float, help="device memory bandwidth, GB/s")
    args = parser.parse_args()

    backend = jax.default_backend()
    num_rows = args.tokens * args.top_k
    schedule = schedule_report(num_rows, args.experts, args.tiling[0])
    print(f"tile schedule: M = {num_rows} rows, E = {args.experts}, row tile {args.tiling[0]}; "
          "visits = grid steps along the row axis (T row tiles, at most T + E - 1); each visit "
          "is a full-tile matmul, so gmm visits / T is the MXU work over the ideal")
    print(markdown_table(
        ["routing", "row tiles T", "schedule T+E-1", "gmm visits", "gmm visits / T",
         "tgmm visits", "empty experts", "max rows/expert"],
        [[r["skew"], r["row_tiles"], r["schedule_size"], r["gmm_visits"],
          f"{r['gmm_visits'] / r['row_tiles']:.2f}", r["tgmm_visits"], r["empty_experts"],
          r["max_expert_rows"]] for r in schedule]))
    payload = {"args": vars(args), "schedule": schedule}
    if backend == "cpu":
        print("\nCPU backend: Pallas kernels run only in interpret mode here, whose time is not a "
              "performance figure; no timings reported. Run on a TPU for throughput.")
    else:
        records = time_matmuls(args, backend)
        print(markdown_table(
            ["impl", "pass", "ms", "TFLOP/s", "% peak", "GB/s", "% peak BW"],
            [[r["impl"], r["pass"], f"{r['seconds'] * 1e3:.3f}", f"{r['tflops']:.1f}",
              f"{100 * r['tflops_of_peak']:.0f}%" if "tflops_of_peak" in r else "-",
              f"{r['gbps']:.0f}",
              f"{100 * r['gbps_of_peak']:.0f}%" if "gbps_of_peak" in r else "-"]
             for r in records]))
        payload["timings"] = records
    print(f"saved {save('pallas_moe', payload)}")


if __name__ == "__main__":
    main()
