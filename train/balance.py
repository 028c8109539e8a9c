"""Loss-free load balancing (report 2.2 / 3.1): after every optimizer step each
MoE layer's router bias moves by `b_e += u * sign(mean_load - load_e)`, outside the gradient.
"""

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.layers.params import stack_layers, unstack_layers


def update_router_bias(balance: dict, load: jax.Array, cfg: ModelConfig, rate: float) -> dict:
    """balance: the model's `balance` collection (scanned or per-layer layout); load: [L_moe, E]
    expert load f_e of every MoE layer in layer order. Returns the updated collection."""
    layers = balance["layers"]
    per_layer = unstack_layers(layers, cfg) if cfg.scan_layers else dict(layers)
    for row, layer in enumerate(cfg.moe_layer_indices()):
        if cfg.is_hash_layer(layer):
            continue  # hash-routed: a fixed choice, no bias
        entry = per_layer[f"layer_{layer}"]["moe"]
        delta = rate * jnp.sign(jnp.mean(load[row]) - load[row])
        per_layer[f"layer_{layer}"] = {
            **per_layer[f"layer_{layer}"], "moe": {**entry, "router_bias": entry["router_bias"] + delta}}
    return {**balance, "layers": stack_layers(per_layer, cfg) if cfg.scan_layers else per_layer}


def has_router_bias(cfg: ModelConfig) -> bool:
    return cfg.moe.router_bias and cfg.num_moe_layers > cfg.moe.hash_layers

