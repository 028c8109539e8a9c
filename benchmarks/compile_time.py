"""Compile time of the tiny model's forward + backward at 12 vs 48 layers, scan on and off.

    python benchmarks/compile_time.py [--depths 12 48] [--no-unscanned]

Layout `SSSF*k` with one leading dense layer. Target: with scan on, 48 layers
compile within 2x the time of 12 layers (the scanned segments do not grow with depth).
"""

import argparse
import time

import jax
import jax.numpy as jnp

from benchmarks.common import markdown_table, save
from model import CausalLM, load_config


def compile_seconds(depth: int, scan: bool) -> float:
    cfg = load_config("configs/tiny.yaml", [
        f"num_layers={depth}", f"layout=SSSF*{depth // 4}", "swiglu_limits=0",
        "swiglu_limits_shared=0", f"scan_layers={str(scan).lower()}"])
    lm = CausalLM(cfg)
    tokens = jnp.zeros((2, 128), jnp.int32)
    variables = jax.eval_shape(lm.init, jax.random.key(0), tokens)

    state = {name: tree for name, tree in variables.items() if name != "params"}

    def loss(params, state):
        out = lm.apply({**state, "params": params}, tokens)
        return jnp.mean(out.logits) + sum(jnp.mean(m) for m in out.mtp_logits)

    start = time.perf_counter()
    jax.jit(jax.grad(loss)).lower(variables["params"], state).compile()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[12, 48])
    parser.add_argument("--no-unscanned", action="store_true", help="skip scan_layers=false")
    args = parser.parse_args()
    modes = [True] if args.no_unscanned else [True, False]
    records = []
    for scan in modes:
        for depth in args.depths:
            seconds = compile_seconds(depth, scan)
            records.append({"layers": depth, "scan": scan, "compile_seconds": seconds})
            print(f"layers={depth} scan={scan}: {seconds:.1f}s", flush=True)
    print(markdown_table(["layers", "scan", "compile s"],
                         [[r["layers"], r["scan"], f"{r['compile_seconds']:.1f}"] for r in records]))
    scanned = [r["compile_seconds"] for r in records if r["scan"]]
    print(f"scan on: {args.depths[-1]} vs {args.depths[0]} layers = "
          f"{scanned[-1] / scanned[0]:.2f}x (target <= 2)")
    save("compile_time", {"records": records})


if __name__ == "__main__":
    main()
