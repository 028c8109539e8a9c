"""Pre-norm decoder block: x + Attn(Norm(x)), then + FFN(Norm(.)) where FFN is SwiGLU or MoE."""

import flax.linen as nn

from model.config import ModelConfig
from model.inference.kv_cache import KVCacheSpec
from model.layers.attention import Attention
from model.layers.common import dtype_of
from model.layers.ffn import SwiGLU
from model.layers.moe import MoE
from model.layers.norm import RMSNorm


class DecoderBlock(nn.Module):
    """x: [B, T, d_model] -> ([B, T, d_model], aux). HF names: input_layernorm, self_attn,
    post_attention_layernorm, mlp (dense) or moe (+ shared_expert)."""

    config: ModelConfig
    attention_type: str
    is_moe: bool
    limit: float = 0.0  # routed-expert clamp
    shared_limit: float = 0.0  # dense FFN / shared-expert clamp
    kv_cache: KVCacheSpec | None = None  # incremental decoding (model/inference/kv_cache.py)

    @nn.compact
    def __call__(self, x, positions, segment_ids):
        cfg = self.config
        norm = dict(eps=cfg.norm_eps, dtype=dtype_of(cfg.compute_dtype),
                    param_dtype=dtype_of(cfg.param_dtype), axis_name="embed")
        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        attn_out, attn_aux = Attention(cfg, self.attention_type, self.kv_cache, name="self_attn")(
            RMSNorm(name="input_layernorm", **norm)(x), positions, segment_ids
        )
        x = x + attn_out
        h = RMSNorm(name="post_attention_layernorm", **norm)(x)
        if self.is_moe:
            ffn_out, ffn_aux = MoE(cfg, self.limit, self.shared_limit, name="moe")(h)
        else:
            ffn_out, ffn_aux = SwiGLU(cfg, cfg.dense_hidden, self.shared_limit, name="mlp")(h), {}
        return x + ffn_out, {**attn_aux, **ffn_aux}
