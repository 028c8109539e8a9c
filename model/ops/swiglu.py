"""The SwiGLU activation with the activation clamp of report 4.1.3, on plain arrays (shared by
the dense FFN and every `moe_impl`).

Clamp with limit L > 0: up = clip(x W_u, -L, L) and the gate capped at L, either after the SiLU
(Step 3.5: gate = min(silu(x W_g), L)) or before it (DeepSeek-V4 report 4.2.3 as transformers'
DeepseekV4Experts/DeepseekV4MLP implement it: gate = silu(min(x W_g, L))). L = 0 disables it.
The two differ only for gate inputs above L (silu(10) = 9.99955 < 10), and there in the
gradient too: the V4 form stops it for every x W_g > L.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

GATE_CLAMPS = ("after_silu", "before_silu")


class SwiGLUClamp(NamedTuple):
    """One SwiGLU's clamp. Hashable, so it passes as one static argument (jit partials, custom
    VJP nondiff arguments) through every `moe_impl`; built from the config's per-layer
    `swiglu_limits[_shared]` and `swiglu_gate_clamp`."""

    limit: float  # L; 0 disables the clamp
    gate: str = "after_silu"  # one of GATE_CLAMPS: where the gate's upper limit applies


def swiglu_activation(gate_pre: jax.Array, up_pre: jax.Array, clamp: SwiGLUClamp) -> jax.Array:
    """silu(gate_pre) * up_pre with the report's clamp; shapes [..., hidden] in, same out."""
    limit = clamp.limit
    if clamp.gate not in GATE_CLAMPS:
        raise ValueError(f"swiglu_gate_clamp={clamp.gate!r}; expected one of {GATE_CLAMPS}")
    if limit <= 0:
        return jax.nn.silu(gate_pre) * up_pre
    if clamp.gate == "before_silu":
        gate = jax.nn.silu(jnp.minimum(gate_pre, limit))
    else:
        gate = jnp.minimum(jax.nn.silu(gate_pre), limit)
    return gate * jnp.clip(up_pre, -limit, limit)
