"""SwiGLU feed-forward with the optional activation clamp of report 4.1.3 (limit L, 0 = off;
the gate's cap after or before the SiLU as `swiglu_gate_clamp` says, see `model.ops.swiglu`)."""

import flax.linen as nn
from jax.ad_checkpoint import checkpoint_name

from model.config import ModelConfig
from model.layers.common import dtype_of
from model.layers.projection import Projection
from model.ops.swiglu import SwiGLUClamp, swiglu_activation


class SwiGLU(nn.Module):
    """x: [..., d_model] -> [..., d_model]; HF names gate_proj / up_proj / down_proj."""

    config: ModelConfig
    hidden: int
    limit: float = 0.0  # the clamp's L; the gate's cap placed by cfg.swiglu_gate_clamp

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        def projection(name, features, axes):
            return Projection((features,), axes, 1, cfg.init_std, dtype_of(cfg.compute_dtype),
                              dtype_of(cfg.param_dtype), name=name)

        gate = projection("gate_proj", self.hidden, ("embed", "mlp"))(x)
        up = projection("up_proj", self.hidden, ("embed", "mlp"))(x)
        h = swiglu_activation(gate, up, SwiGLUClamp(self.limit, cfg.swiglu_gate_clamp))
        out = projection("down_proj", x.shape[-1], ("mlp", "embed"))(h)
        return checkpoint_name(out, "ffn_out")
