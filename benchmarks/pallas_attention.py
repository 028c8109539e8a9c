"""Pallas flash attention: KV blocks visited vs T (runs anywhere) and kernel speed (GPU).

    python -m benchmarks.pallas_attention [--lengths 2048 ... 65536] [--window 512] [--block 128]
        [--time-lengths 4096 16384] [--heads 32 --kv-heads 4 --head-dim 128] [--dtype bfloat16]
        [--peak-tflops X --peak-gbps Y]

(a) Block counts come from `visited_blocks`, the grid logic the kernels use for their loop
bounds: SWA grows linearly in T, full causal quadratically. "pair efficiency" is visible
(query, key) pairs / (visited blocks x block_q x block_k): the masked share of visited work.
(b) On a GPU the forward and forward+backward are timed. TFLOP/s counts visible pairs only
(4·D FLOPs per pair forward, backward 2.5x forward as in the FlashAttention-2 paper;
recomputation not counted); GB/s uses compulsory HBM traffic (every input and output once).
Both are compared with the device's peak from a small datasheet table (dense bf16) or the
--peak-* flags. On CPU the kernels only run in interpret mode, whose time is not a performance
figure, so timing is skipped; on TPU the kernel is not available (see the kernel's docstring).
"""

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import markdown_table, save, time_compiled
from model.flops import visible_pairs
from pallas_kernels.flash_attention import flash_attention, visited_blocks

# device_kind substring -> (dense bf16 TFLOP/s, HBM GB/s), vendor datasheets; first match wins.
PEAKS = [
    ("H100 PCIe", (756.0, 2000.0)),
    ("H100", (989.0, 3350.0)),  # SXM
    ("H200", (989.0, 4800.0)),
    ("A100-SXM4-40GB", (312.0, 1555.0)),
    ("A100", (312.0, 2039.0)),  # 80GB SXM
    ("L40S", (362.0, 864.0)),
    ("L4", (121.0, 300.0)),
    ("TPU v4", (275.0, 1228.0)),
    ("TPU v5 lite", (197.0, 819.0)),
    ("TPU v5", (459.0, 2765.0)),  # v5p
    ("TPU v6 lite", (918.0, 1640.0)),
]


def block_table(lengths, window, block):
    rows, records = [], []
    for length in lengths:
        swa = visited_blocks(length, window, block, block)
        full = visited_blocks(length, None, block, block)
        record = {"length": length, "swa_blocks": swa, "full_blocks": full,
                  "swa_pair_efficiency": visible_pairs(length, window) / (swa * block * block),
                  "full_pair_efficiency": visible_pairs(length, None) / (full * block * block)}
        records.append(record)
        rows.append([length, swa, full, f"{full / swa:.1f}", f"{swa / -(-length // block):.2f}",
                     f"{record['swa_pair_efficiency']:.2f}",
                     f"{record['full_pair_efficiency']:.2f}"])
    headers = ["T", "SWA blocks", "full blocks", "full/SWA", "SWA blocks per q-block",
               "SWA pair efficiency", "full pair efficiency"]
    return markdown_table(headers, rows), records


def peak_for(device_kind: str, tflops: float | None, gbps: float | None):
    table = next((peak for name, peak in PEAKS if name in device_kind), (None, None))
    return (tflops or table[0]), (gbps or table[1])


def time_kernels(args, length, window):
    """Seconds of the forward and of forward+backward (jitted, median of repeats)."""
    b, h, kv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(length), 4)
    q = jax.random.normal(keys[0], (b, length, h, d), dtype)
    k = jax.random.normal(keys[1], (b, length, kv, d), dtype)
    v = jax.random.normal(keys[2], (b, length, kv, d), dtype)
    cotangent = jax.random.normal(keys[3], (b, length, h, d), dtype)
    blocks = dict(block_q=args.kernel_block_q, block_k=args.kernel_block_k)

    def attention(q, k, v):
        return flash_attention(q, k, v, window=window, **blocks)

    def forward_backward(q, k, v, cotangent):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(cotangent)

    fwd = jax.jit(attention).lower(q, k, v).compile()
    both = jax.jit(forward_backward).lower(q, k, v, cotangent).compile()
    return (time_compiled(fwd, q, k, v, repeats=args.repeats),
            time_compiled(both, q, k, v, cotangent, repeats=args.repeats))


def timing_table(args, peak_tflops, peak_gbps):
    b, h, kv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    size = jnp.dtype(args.dtype).itemsize
    rows, records = [], []
    for length in args.time_lengths:
        for name, window in (("swa", args.window), ("full", None)):
            fwd_s, both_s = time_kernels(args, length, window)
            fwd_flops = 4 * visible_pairs(length, window) * d * b * h
            q_bytes = b * length * h * d * size  # also o, dO, dq
            kv_bytes = b * length * kv * d * size  # each of k, v, dk, dv
            row_bytes = 4 * b * h * length  # lse or delta, float32
            fwd_bytes = 2 * q_bytes + 2 * kv_bytes + row_bytes  # q, k, v in; o, lse out
            # backward: q, o, dO, k, v, lse, delta in; dq, dk, dv out
            both_bytes = fwd_bytes + 4 * q_bytes + 4 * kv_bytes + 2 * row_bytes
            record = {"length": length, "kind": name, "fwd_seconds": fwd_s,
                      "fwd_bwd_seconds": both_s,
                      "fwd_tflops": fwd_flops / fwd_s / 1e12,
                      "fwd_bwd_tflops": 3.5 * fwd_flops / both_s / 1e12,
                      "fwd_gbps": fwd_bytes / fwd_s / 1e9,
                      "fwd_bwd_gbps": both_bytes / both_s / 1e9}
            records.append(record)

            def of_peak(value, peak):
                return f"{value:.1f}" + (f" ({100 * value / peak:.0f}%)" if peak else "")

            rows.append([length, name, f"{fwd_s * 1e3:.2f}", f"{both_s * 1e3:.2f}",
                         of_peak(record["fwd_tflops"], peak_tflops),
                         of_peak(record["fwd_bwd_tflops"], peak_tflops),
                         of_peak(record["fwd_gbps"], peak_gbps),
                         of_peak(record["fwd_bwd_gbps"], peak_gbps)])
            print(f"T={length} {name}: fwd {fwd_s * 1e3:.2f} ms, fwd+bwd {both_s * 1e3:.2f} ms",
                  flush=True)
    headers = ["T", "kind", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s", "fwd+bwd TFLOP/s",
               "fwd GB/s", "fwd+bwd GB/s"]
    return markdown_table(headers, rows), records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+",
                        default=[2048, 4096, 8192, 16384, 32768, 65536],
                        help="sequence lengths of the visited-block table")
    parser.add_argument("--window", type=int, default=512, help="SWA window W")
    parser.add_argument("--block", type=int, default=128, help="block_q = block_k of the table")
    parser.add_argument("--time-lengths", type=int, nargs="+", default=[4096, 16384],
                        help="sequence lengths to time (accelerators only)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--kernel-block-q", type=int, default=None,
                        help="kernel block_q when timing (default: per-backend default)")
    parser.add_argument("--kernel-block-k", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="device peak TFLOP/s (default: table by device_kind)")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="device peak HBM GB/s (default: table by device_kind)")
    args = parser.parse_args()
    for name in ("window", "block", "heads", "kv_heads", "head_dim", "batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")

    table, block_records = block_table(args.lengths, args.window, args.block)
    print(f"KV blocks visited per (batch, head), W={args.window}, "
          f"block_q=block_k={args.block}:")
    print(table)
    payload = {"window": args.window, "block": args.block, "visited_blocks": block_records}

    backend = jax.default_backend()
    if backend == "gpu":
        device_kind = jax.devices()[0].device_kind
        peak_tflops, peak_gbps = peak_for(device_kind, args.peak_tflops, args.peak_gbps)
        print(f"\nTiming on {device_kind} (peak {peak_tflops} TFLOP/s, {peak_gbps} GB/s; "
              f"B={args.batch} H={args.heads} K={args.kv_heads} D={args.head_dim} "
              f"{args.dtype}):")
        timing, timing_records = timing_table(args, peak_tflops, peak_gbps)
        print(timing)
        payload.update(device_kind=device_kind, timing=timing_records,
                       peak_tflops=peak_tflops, peak_gbps=peak_gbps)
    elif backend == "tpu":
        print("\nTiming skipped: the flash-attention kernel is written for GPU (Triton) and is "
              "not available on TPU yet (see pallas_kernels/flash_attention.py).")
    else:
        print(f"\nTiming skipped: on {backend} the Pallas kernels run only in interpret mode, "
              "whose time is not a performance figure.")
    print(f"results: {save('pallas_attention', payload)}")


if __name__ == "__main__":
    main()
