"""Per layer kind, what splitting the sequence costs beyond the tokens themselves: one attention
layer of the tiny Step 3.5 (S and F) and DeepSeek-V4 (W, C, H) presets, forward and backward,
at T tokens with `context` = C against C rows of T / C tokens on one device (the same tokens
and per-token work, without the exchanges and without attention across the chunks), timed
side by side in the same rounds. A sliding-window layer's ratio stays near 1 at every T (its
halo is W - 1 rows); a full-attention layer's grows with T (each chunk attends to the whole
sequence before it). The F layer runs in both context layouts, with XLA's FLOP count per
device (`cost_analysis`) beside the time."""

from __future__ import annotations

import functools
import statistics
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model.config import SHARED_KV_KINDS
from model.layers.attention import Attention
from model.layers.shared_kv_attention import SharedKVAttention
from benchmarks.common import interleaved_times, markdown_table, save
from model.parallel.rules import use_mesh
from train.config import MeshConfig, load_run_config
from train.parallel.sharding import make_mesh

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
KINDS = {"step35": ("tiny.yaml", "SF"), "deepseek_v4": ("tiny_deepseek_v4.yaml", "WCH")}


def _layer_step(cfg, kind: str, rows: int, length: int):
    """(jitted fwd+bwd of one attention layer of `kind` on [rows, length], its inputs)."""
    layer = (SharedKVAttention if kind in SHARED_KV_KINDS else Attention)(cfg, kind)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(rows, length, cfg.d_model)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
    segments = jnp.ones((rows, length), jnp.int32)
    params = jax.jit(layer.init)(jax.random.key(0), x[:, :64], positions[:, :64],
                                 segments[:, :64])

    def loss(params, x):
        out, aux = layer.apply(params, x, positions, segments)
        return jnp.sum(out * out) + sum(jnp.sum(v) for v in jax.tree.leaves(aux))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (nn.meta.unbox(params), x)


def _run(fn, args) -> None:
    jax.block_until_ready(fn(*args))


def _flops(compiled) -> float | None:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return None if not cost else float(cost.get("flops", 0.0))


def layer_ratios(lengths: list[int], context: int, rounds: int = 3) -> list[dict]:
    rows = []
    mesh = make_mesh(MeshConfig(context=context, data=1), jax.devices()[:context])
    for family, (config, kinds) in KINDS.items():
        base = load_run_config(CONFIGS / config).model
        for kind in kinds:
            layouts = ("balanced", "contiguous") if kind == "F" else ("auto",)
            for length in lengths:
                steps, flops = {}, {}
                for layout in layouts:
                    cfg = base.replace(context_layout=layout)
                    with use_mesh(mesh):
                        fn, args = _layer_step(cfg, kind, 1, length)
                        compiled = fn.lower(*args).compile()
                    steps[layout], flops[layout] = (compiled, args), _flops(compiled)
                fn, args = _layer_step(base, kind, context, length // context)
                compiled = fn.lower(*args).compile()
                steps["rows"], flops["rows"] = (compiled, args), _flops(compiled)
                times = interleaved_times({name: functools.partial(_run, *step)
                                           for name, step in steps.items()}, rounds)
                seconds = {name: statistics.median(t) for name, t in times.items()}
                row = {"family": family, "kind": kind, "length": length, "seconds": seconds,
                       "all_seconds": times, "flops_per_device": flops,
                       "ratio": {k: v / seconds["rows"] for k, v in seconds.items()
                                 if k != "rows"}}
                print(row, flush=True)
                rows.append(row)
    return rows


def run_layers(args) -> None:
    rows = layer_ratios(args.layer_lengths, args.context)
    path = save("context_parallel_layers", {"context": args.context, "layers": rows})
    print(markdown_table(
        ["layer", "T", "layout", "split s", f"{args.context} rows of T/{args.context} s",
         "ratio"],
        [[f"{r['family']} {r['kind']}", r["length"], layout, f"{r['seconds'][layout]:.3f}",
          f"{r['seconds']['rows']:.3f}", f"{ratio:.2f}"]
         for r in rows for layout, ratio in r["ratio"].items()]))
    print(f"wrote {path}")
