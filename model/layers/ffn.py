"""SwiGLU feed-forward with the optional activation clamp of report 4.1.3.

Clamp with limit L > 0: gate = min(silu(x W_g), L), up = clip(x W_u, -L, L); L = 0 disables it.
"""

import flax.linen as nn
from jax.ad_checkpoint import checkpoint_name

from model.config import ModelConfig
from model.layers.common import dtype_of, normal_init
from model.ops.swiglu import swiglu_activation


class SwiGLU(nn.Module):
    """x: [..., d_model] -> [..., d_model]; HF names gate_proj / up_proj / down_proj."""

    config: ModelConfig
    hidden: int
    limit: float = 0.0

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        dense = dict(use_bias=False, dtype=dtype_of(cfg.compute_dtype),
                     param_dtype=dtype_of(cfg.param_dtype))
        gate = nn.Dense(self.hidden, kernel_init=normal_init(cfg.init_std, ("embed", "mlp")),
                        name="gate_proj", **dense)(x)
        up = nn.Dense(self.hidden, kernel_init=normal_init(cfg.init_std, ("embed", "mlp")),
                      name="up_proj", **dense)(x)
        h = swiglu_activation(gate, up, self.limit)
        out = nn.Dense(x.shape[-1], kernel_init=normal_init(cfg.init_std, ("mlp", "embed")),
                       name="down_proj", **dense)(h)
        return checkpoint_name(out, "ffn_out")
