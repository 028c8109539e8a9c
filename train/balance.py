"""Loss-free load balancing (report 2.2 / 3.1): after every optimizer step each
MoE layer's router bias moves by `b_e += u * sign(mean_load - load_e)`, outside the gradient.
"""

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.layers.params import stack_layers, unstack_layers


def _moved(block: dict, load: jax.Array, rate: float) -> dict:
    """A block's balance entry with its MoE router bias moved by the rule above."""
    moe = block["moe"]
    delta = rate * jnp.sign(jnp.mean(load) - load)
    return {**block, "moe": {**moe, "router_bias": moe["router_bias"] + delta}}


def update_router_bias(balance: dict, load: jax.Array | None, cfg: ModelConfig, rate: float,
                       mtp_load: jax.Array | None = None) -> dict:
    """balance: the model's `balance` collection (scanned or per-layer layout); load: [L_moe, E]
    expert load f_e of every MoE layer in layer order; mtp_load: [h, E] of the first h MTP heads
    when their blocks are MoE layers (`mtp.block: layer`). Returns the updated collection."""
    updated = dict(balance)
    if "layers" in balance:  # absent when no decoder layer has a bias (an MTP block may)
        layers = balance["layers"]
        per_layer = unstack_layers(layers, cfg) if cfg.scan_layers else dict(layers)
        for row, layer in enumerate(cfg.moe_layer_indices()):
            if cfg.is_hash_layer(layer):
                continue  # hash-routed: a fixed choice, no bias
            per_layer[f"layer_{layer}"] = _moved(per_layer[f"layer_{layer}"], load[row], rate)
        updated["layers"] = stack_layers(per_layer, cfg) if cfg.scan_layers else per_layer
    for head, head_load in enumerate([] if mtp_load is None else mtp_load):
        name = f"mtp_{head}"
        updated[name] = {**balance[name], "block": _moved(balance[name]["block"], head_load, rate)}
    return updated


def has_router_bias(cfg: ModelConfig) -> bool:
    mtp_moe = cfg.mtp.block == "layer" and cfg.mtp.num_heads > 0
    return cfg.moe.router_bias and (cfg.num_moe_layers > cfg.moe.hash_layers or mtp_moe)

