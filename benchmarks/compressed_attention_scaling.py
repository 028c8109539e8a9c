"""DeepSeek-V4's compressed attention layers (CSA, HCA) and its sliding-window layer (W) against a
dense full-attention layer of the same width: fwd+bwd time and compiled peak scratch memory.

    python -m benchmarks.compressed_attention_scaling [--lengths 2048 4096 8192 16384]

Whole layers in float32 on one sequence, gradients to the parameters and the input; the CSA
objective includes the indexer's KL loss, as in training. The V4 layers keep V4-Flash's
compression settings (window 128, CSA rate 4 with top-512 selection, HCA rate 128) at a
smaller width: d_model 512, 8 query heads of 128 channels (32 rotary), one shared KV entry,
8 indexer heads of 32 channels (V4-Flash's indexer-to-attention width ratio, 1:4). The dense
layer is Step 3.5's full-attention layer at that width (8 query heads, one KV head of 128,
sink, XLA core). Target: time(16k)/time(2k) <= 12 for CSA and HCA.

A layer whose compiled scratch exceeds --max-scratch-gib is reported, not run.
"""

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.common import interleaved, markdown_table, save, temp_bytes
from model.config import load_config
from model.layers.attention import Attention
from model.layers.shared_kv_attention import SharedKVAttention

V4_WIDTH = [
    "d_model=512", "window=128", "shared_kv_attention.num_heads=8",
    "shared_kv_attention.head_dim=128", "shared_kv_attention.rope_dims=32",
    "shared_kv_attention.q_lora_rank=256", "shared_kv_attention.o_groups=4",
    "shared_kv_attention.o_lora_rank=256", "shared_kv_attention.csa_rate=4",
    "shared_kv_attention.hca_rate=128", "shared_kv_attention.index_heads=8",
    "shared_kv_attention.index_head_dim=32", "shared_kv_attention.index_topk=512",
    "shared_kv_attention.query_chunk=128",
]
DENSE_WIDTH = [
    "d_model=512", "head_dim=128", "num_kv_heads=1", "full_attention.num_heads=8",
    "full_attention.partial_rotary_factor=0.25", "gate=sink", "attention_impl=xla",
]
LAYERS = ("C", "H", "W", "dense")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def layer_step(kind: str, length: int):
    """(compiled fwd+bwd of the layer on [1, length, 512], its arguments)."""
    if kind == "dense":
        return model_layer_step(load_config(CONFIGS / "tiny.yaml", DENSE_WIDTH), kind, length)
    return model_layer_step(load_config(CONFIGS / "tiny_deepseek_v4.yaml", V4_WIDTH), kind,
                            length)


def model_layer_step(cfg, kind: str, length: int):
    """(compiled fwd+bwd of one attention layer of `cfg` on [1, length, d_model], its
    arguments): kind "C", "H" or "W" a shared-KV layer, "dense" a full-attention layer."""
    module = Attention(cfg, "F") if kind == "dense" else SharedKVAttention(cfg, kind)
    x = jax.random.normal(jax.random.key(length), (1, length, cfg.d_model), jnp.float32)
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    segment_ids = jnp.ones((1, length), jnp.int32)
    params = module.init(jax.random.key(0), x[:, :256], positions[:, :256],
                         segment_ids[:, :256])

    def loss(params, x):
        out, aux = module.apply(params, x, positions, segment_ids)
        return jnp.mean(jnp.square(out)) + aux.get("indexer_loss", 0.0)

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x).compile()
    return compiled, (params, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--layers", nargs="+", choices=LAYERS, default=list(LAYERS))
    parser.add_argument("--rounds", type=int, default=3, help="timed calls per layer")
    parser.add_argument("--max-scratch-gib", type=float, default=8.0)
    args = parser.parse_args()

    records = []
    for length in args.lengths:
        record, steps = {"length": length}, {}
        for kind in args.layers:
            compiled, call_args = layer_step(kind, length)
            scratch = temp_bytes(compiled)
            record[f"{kind}_temp_bytes"] = scratch
            if scratch is not None and scratch > args.max_scratch_gib * 2**30:
                record[f"{kind}_seconds"] = None  # not run: over the memory limit
            else:
                steps[kind] = lambda c=compiled, a=call_args: jax.block_until_ready(c(*a))
        # Interleaved rounds: a slow patch of the shared machine hits every layer alike.
        for kind, seconds in interleaved(steps, args.rounds).items():
            record[f"{kind}_seconds"] = seconds
        records.append(record)
        print(f"T={length}: " + ", ".join(
            f"{k} {record[f'{k}_seconds']:.3f}s" if record[f"{k}_seconds"] else f"{k} not run"
            for k in args.layers), flush=True)

    def cell(record, kind):
        seconds, scratch = record[f"{kind}_seconds"], record[f"{kind}_temp_bytes"]
        mib = "?" if scratch is None else f"{scratch / 2**20:.0f}"
        return f"{seconds * 1e3:.0f} / {mib}" if seconds else f"not run / {mib}"

    rows = [[r["length"], *(cell(r, k) for k in args.layers)] for r in records]
    print(markdown_table(["T", *(f"{k} ms / scratch MiB" for k in args.layers)], rows))
    first, last = records[0], records[-1]
    ratios = {k: last[f"{k}_seconds"] / first[f"{k}_seconds"] for k in args.layers
              if first[f"{k}_seconds"] and last[f"{k}_seconds"]}
    print(f"time({last['length']})/time({first['length']}): " + ", ".join(
        f"{k} {r:.2f}x" for k, r in ratios.items()) + " (target <= 12 for C and H)")
    save("compressed_attention_scaling", {"v4_overrides": V4_WIDTH,
                                          "dense_overrides": DENSE_WIDTH,
                                          "records": records, "ratios": ratios})


if __name__ == "__main__":
    main()
