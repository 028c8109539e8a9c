"""Zero-centred RMSNorm: `y = x / sqrt(mean(x^2) + eps) * (1 + w)`, w init 0
(docs/architecture.md, "Exact semantics").

Computed in float32 whatever the compute dtype; the checkpoint stores `w` as an offset from 1.
"""


import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
    """Normalises the last axis. x: [..., dim] -> same shape, in `dtype`."""

    eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    axis_name: str = "norm"  # logical axis of the weight

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param(
            "weight",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), (self.axis_name,)),
            (x.shape[-1],),
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (x32 * inv_rms * (1.0 + weight.astype(jnp.float32))).astype(self.dtype)
