"""Converts the layer-stack variables between the scanned and the per-layer layouts.

Scanned (`scan_layers=True`): `layers/segment_{s}/block_{j}/...`, leaves stacked over the
segment's repeats; per-layer (`scan_layers=False`): `layers/layer_{i}/...`. Works on every
collection (`params`, `balance`) of unboxed variables (`flax.linen.meta.unbox`).
"""

from typing import Any

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.layers.layer_plan import layer_kinds, plan_segments


def unstack_layers(stack: dict, cfg: ModelConfig) -> dict:
    """{'segment_s': {'block_j': [repeats, ...]}} -> {'layer_i': [...]}; absent blocks stay absent."""
    layers = {}
    for s, seg in enumerate(plan_segments(layer_kinds(cfg))):
        for j, block in stack.get(f"segment_{s}", {}).items():
            j = int(j.removeprefix("block_"))
            for r in range(seg.repeats):
                layers[f"layer_{seg.start + r * seg.period + j}"] = jax.tree.map(
                    lambda a: a[r], block)
    return layers


def stack_layers(layers: dict, cfg: ModelConfig) -> dict:
    """Inverse of `unstack_layers`."""
    stack = {}
    for s, seg in enumerate(plan_segments(layer_kinds(cfg))):
        blocks = {}
        for j in range(seg.period):
            names = [f"layer_{seg.start + r * seg.period + j}" for r in range(seg.repeats)]
            if names[0] in layers:  # collections such as `balance` skip dense layers
                blocks[f"block_{j}"] = jax.tree.map(lambda *a: jnp.stack(a),
                                                    *[layers[n] for n in names])
        if blocks:
            stack[f"segment_{s}"] = blocks
    return stack


def convert_layer_layout(variables: dict[str, Any], cfg: ModelConfig, *, to_scan: bool) -> dict:
    """Re-lays the `layers` subtree of every collection; other entries are passed through."""
    convert = stack_layers if to_scan else unstack_layers
    return {
        name: {**tree, "layers": convert(tree["layers"], cfg)} if "layers" in tree else tree
        for name, tree in variables.items()
    }
