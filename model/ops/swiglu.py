"""The SwiGLU activation with the activation clamp of report 4.1.3, on plain arrays (shared by
the dense FFN and every `moe_impl`).

Clamp with limit L > 0: up = clip(x W_u, -L, L) and the gate capped at L, either after the SiLU
(Step 3.5: gate = min(silu(x W_g), L)) or before it (DeepSeek-V4 report 4.2.3 as transformers'
DeepseekV4Experts/DeepseekV4MLP implement it: gate = silu(min(x W_g, L))). L = 0 disables it.
The two differ only for gate inputs above L (silu(10) = 9.99955 < 10), and there in the
gradient too: the V4 form stops it for every x W_g > L.
"""

import jax
import jax.numpy as jnp

GATE_CLAMPS = ("after_silu", "before_silu")


def swiglu_activation(gate_pre: jax.Array, up_pre: jax.Array, limit: float,
                      gate_clamp: str = "after_silu") -> jax.Array:
    """silu(gate_pre) * up_pre with the report's clamp; shapes [..., hidden] in, same out.

    gate_clamp: one of GATE_CLAMPS, where the gate's upper limit applies.
    """
    if gate_clamp not in GATE_CLAMPS:
        raise ValueError(f"gate_clamp={gate_clamp!r}; expected one of {GATE_CLAMPS}")
    if limit <= 0:
        return jax.nn.silu(gate_pre) * up_pre
    if gate_clamp == "before_silu":
        gate = jax.nn.silu(jnp.minimum(gate_pre, limit))
    else:
        gate = jnp.minimum(jax.nn.silu(gate_pre), limit)
    return gate * jnp.clip(up_pre, -limit, limit)
