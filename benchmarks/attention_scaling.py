"""SWA (chunked local, O(T·W)) vs full causal attention: time and compiled peak scratch memory.

    python benchmarks/attention_scaling.py [--lengths 2048 4096 8192 16384] [--window 512]

Forward + backward of the XLA cores in float32 on one KV group. Target: SWA time
grows ~linearly, time(16k)/time(2k) <= 10; full attention grows ~quadratically.
"""

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import markdown_table, save, temp_bytes, time_compiled
from model.ops.attention_cores import dense_attention, local_attention


def build(core, window, shape):
    def loss(q, k, v):
        return jnp.sum(core(q, k, v, window=window, segment_ids=None, sink=None))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    batch, length, heads, kv_heads, head_dim = shape
    q = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((batch, length, kv_heads, head_dim), jnp.float32)
    return grad.lower(q, kv, kv).compile()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rows, records = [], []
    for length in args.lengths:
        shape = (1, length, args.heads, 1, args.head_dim)
        keys = jax.random.split(jax.random.key(length), 3)
        q = jax.random.normal(keys[0], shape[:3] + (args.head_dim,))
        k = jax.random.normal(keys[1], (1, length, 1, args.head_dim))
        v = jax.random.normal(keys[2], (1, length, 1, args.head_dim))
        record = {"length": length}
        for name, core, window in (("swa", local_attention, args.window),
                                   ("full", dense_attention, None)):
            compiled = build(core, window, shape)
            record[f"{name}_seconds"] = time_compiled(compiled, q, k, v, repeats=args.repeats)
            record[f"{name}_temp_bytes"] = temp_bytes(compiled)
        records.append(record)
        rows.append([length, f"{record['swa_seconds'] * 1e3:.1f}",
                     f"{record['swa_temp_bytes'] / 2**20:.0f}",
                     f"{record['full_seconds'] * 1e3:.1f}",
                     f"{record['full_temp_bytes'] / 2**20:.0f}"])
        print(f"T={length}: swa {record['swa_seconds']:.3f}s full {record['full_seconds']:.3f}s",
              flush=True)
    first, last = records[0], records[-1]
    ratio_swa = last["swa_seconds"] / first["swa_seconds"]
    ratio_full = last["full_seconds"] / first["full_seconds"]
    print(markdown_table(["T", "SWA ms", "SWA scratch MiB", "full ms", "full scratch MiB"], rows))
    print(f"time({last['length']})/time({first['length']}): SWA {ratio_swa:.2f}x "
          f"(target <= 10), full {ratio_full:.2f}x")
    save("attention_scaling", {"window": args.window, "heads": args.heads,
                               "head_dim": args.head_dim, "records": records,
                               "swa_ratio": ratio_swa, "full_ratio": ratio_full})


if __name__ == "__main__":
    main()
