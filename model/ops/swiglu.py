"""The SwiGLU activation with the activation clamp of report 4.1.3, on plain arrays (shared by
the dense FFN and every `moe_impl`).

Clamp with limit L > 0: gate = min(silu(x W_g), L), up = clip(x W_u, -L, L); L = 0 disables it.
"""

import jax
import jax.numpy as jnp


def swiglu_activation(gate_pre: jax.Array, up_pre: jax.Array, limit: float) -> jax.Array:
    """silu(gate_pre) * up_pre with the report's clamp; shapes [..., hidden] in, same out."""
    gate = jax.nn.silu(gate_pre)
    if limit > 0:
        gate = jnp.minimum(gate, limit)
        up_pre = jnp.clip(up_pre, -limit, limit)
    return gate * up_pre
