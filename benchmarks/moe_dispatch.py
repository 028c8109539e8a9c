"""MoE routed-expert layer: `sorted` vs `ragged_dot` vs a dense SwiGLU of the same active FLOPs.

    python benchmarks/moe_dispatch.py [--tokens 4096] [--d-model 512] [--experts 64] [--top-k 8]

Forward + backward in float32. The dense FFN has hidden = top_k * expert_hidden, so it does the
same matmul FLOPs as the routed experts. Target (issue #2): `sorted` <= 1.5x the dense time.
"""

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import markdown_table, save, time_compiled
from model.config import MoEConfig
from model.layers.moe import routed_experts
from model.layers.router import route
from model.ops.moe_dispatch import ExpertWeights
from model.ops.swiglu import swiglu_activation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--impls", nargs="+", default=["sorted", "ragged_dot"],
                        choices=["sorted", "ragged_dot"], help="MoE implementations to time")
    args = parser.parse_args()

    n, d, e, k, f = args.tokens, args.d_model, args.experts, args.top_k, args.expert_hidden
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (n, d))
    logits = jax.random.normal(keys[1], (n, e))
    routing = route(logits, None, MoEConfig(num_experts=e, top_k=k, num_ep_groups=1))
    experts = ExpertWeights(*(jax.random.normal(keys[2 + i], shape) * 0.02 for i, shape in
                              enumerate([(e, d, f), (e, d, f), (e, f, d)])))
    dense = [jax.random.normal(keys[5], shape) * 0.02 for shape in [(d, k * f), (d, k * f),
                                                                    (k * f, d)]]

    def moe_loss(impl):
        def loss(x, weights):
            y, _ = routed_experts(x, routing.indices, routing.weights, ExpertWeights(*weights),
                                  limit=0.0, impl=impl, block_size=128)
            return jnp.sum(y)
        return loss

    def dense_loss(x, weights):
        gate, up, down = weights
        return jnp.sum(swiglu_activation(x @ gate, x @ up, 0.0) @ down)

    flops = 3 * 2 * n * k * 3 * d * f  # fwd + bwd (2x fwd) of three matmuls per routed copy
    rows, records = [], []
    cases = [("dense FFN", dense_loss, dense)]
    cases += [(impl, moe_loss(impl), tuple(experts)) for impl in args.impls]
    for name, loss, weights in cases:
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        seconds = time_compiled(step, x, weights, repeats=args.repeats)
        records.append({"impl": name, "seconds": seconds, "gflops": flops / seconds / 1e9})
        print(f"{name}: {seconds * 1e3:.1f} ms", flush=True)
    dense_seconds = records[0]["seconds"]
    for record in records:
        record["vs_dense"] = record["seconds"] / dense_seconds
        rows.append([record["impl"], f"{record['seconds'] * 1e3:.1f}",
                     f"{record['gflops']:.1f}", f"{record['vs_dense']:.2f}x"])
    print(markdown_table(["impl", "fwd+bwd ms", "GFLOP/s", "vs dense"], rows))
    save("moe_dispatch", {"tokens": n, "d_model": d, "experts": e, "top_k": k,
                          "expert_hidden": f, "records": records})


if __name__ == "__main__":
    main()
