"""Small helpers shared by the model modules: dtypes and initialisers with logical axis names.

Logical axis names used on params (one rules table maps them to mesh axes, see `train/`):
`vocab`, `embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `expert`, `expert_mlp`, `norm`,
`layers` (the stacked axis added by `nn.scan`). Activations: `batch`, `length`, `act_embed`.
"""

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp


def dtype_of(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def normal_init(std: float, axes: Sequence[str]):
    """Normal(0, std) initialiser whose param carries the logical axis names `axes`."""
    return nn.with_logical_partitioning(nn.initializers.normal(stddev=std), tuple(axes))
