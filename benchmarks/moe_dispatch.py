"""MoE routed-expert layer: `sorted` vs `ragged_dot` vs a dense SwiGLU of the same active FLOPs.

    python -m benchmarks.moe_dispatch [--tokens 4096] [--d-model 512] [--experts 64] [--top-k 8]

Forward + backward in float32. The dense FFN has hidden = top_k * expert_hidden, so it does the
same matmul FLOPs as the routed experts; it runs on `model.ops.linear` like the model's dense
FFN. Target: `sorted` <= 1.5x the dense time.
The cases are timed interleaved (one call of each per round) and the routing is an argument of
the compiled step, not a constant, so load from other processes hits all cases alike and XLA
cannot precompute the dispatch. Reports the median per case and its ratio to the dense median.
"""

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import interleaved, markdown_table, save
from model.config import MoEConfig
from model.layers.moe import routed_experts
from model.layers.router import route
from model.ops.linear import linear
from model.ops.moe_dispatch import ExpertWeights
from model.ops.swiglu import SwiGLUClamp, swiglu_activation


def time_moe_layer(*, tokens: int, d_model: int, experts: int, top_k: int, expert_hidden: int,
                   block_size: int, rounds: int, impls, dtype=jnp.float32) -> list[dict]:
    """Forward + backward median seconds of the routed experts per `moe_impl` in `impls` and of
    the dense SwiGLU of equal active FLOPs ("dense FFN"), interleaved; one record per case with
    its GFLOP/s and its ratio to the dense time. Also used by benchmarks.gpu.suite."""
    n, d, e, k, f = tokens, d_model, experts, top_k, expert_hidden
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (n, d), dtype)
    logits = jax.random.normal(keys[1], (n, e))
    routing = route(logits, None, MoEConfig(num_experts=e, top_k=k, num_ep_groups=1))
    experts_w = ExpertWeights(*((jax.random.normal(keys[2 + i], shape) * 0.02).astype(dtype)
                                for i, shape in enumerate([(e, d, f), (e, d, f), (e, f, d)])))
    dense = [(jax.random.normal(keys[5], shape) * 0.02).astype(dtype)
             for shape in [(d, k * f), (d, k * f), (k * f, d)]]

    def moe_loss(impl):
        def loss(x, weights, indices, combine_weights):
            y, _ = routed_experts(x, indices, combine_weights, ExpertWeights(*weights),
                                  clamp=SwiGLUClamp(0.0), impl=impl, block_size=block_size)
            return jnp.sum(y.astype(jnp.float32))
        return loss

    def dense_loss(x, weights, indices, combine_weights):
        del indices, combine_weights
        gate, up, down = weights  # through model.ops.linear, as the model's dense FFN
        h = swiglu_activation(linear(x, gate), linear(x, up), SwiGLUClamp(0.0))
        return jnp.sum(linear(h, down).astype(jnp.float32))

    cases = {"dense FFN": (dense_loss, dense)}
    cases.update({impl: (moe_loss(impl), tuple(experts_w)) for impl in impls})
    steps = {name: jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
             for name, (loss, _) in cases.items()}
    calls = {name: lambda step=steps[name], w=w: jax.block_until_ready(
                 step(x, w, routing.indices, routing.weights))
             for name, (_, w) in cases.items()}
    seconds = interleaved(calls, rounds)

    flops = 3 * 2 * n * k * 3 * d * f  # fwd + bwd (2x fwd) of three matmuls per routed copy
    return [{"impl": name, "seconds": median, "gflops": flops / median / 1e9,
             "vs_dense": median / seconds["dense FFN"]} for name, median in seconds.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-hidden", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=MoEConfig().block_size,
                        help="moe.block_size (`sorted`: largest row chunk)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--impls", nargs="+", default=["sorted", "ragged_dot"],
                        choices=["sorted", "ragged_dot"], help="MoE implementations to time")
    args = parser.parse_args()

    records = time_moe_layer(tokens=args.tokens, d_model=args.d_model, experts=args.experts,
                             top_k=args.top_k, expert_hidden=args.expert_hidden,
                             block_size=args.block_size, rounds=args.rounds, impls=args.impls)
    rows = [[r["impl"], f"{r['seconds'] * 1e3:.1f}", f"{r['gflops']:.1f}",
             f"{r['vs_dense']:.2f}x"] for r in records]
    print(markdown_table(["impl", "fwd+bwd ms", "GFLOP/s", "vs dense"], rows))
    save("moe_dispatch", {"tokens": args.tokens, "d_model": args.d_model,
                          "experts": args.experts, "top_k": args.top_k,
                          "expert_hidden": args.expert_hidden, "block_size": args.block_size,
                          "rounds": args.rounds, "records": records})


if __name__ == "__main__":
    main()
