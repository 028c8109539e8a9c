"""Pre-norm decoder block: attention then FFN (SwiGLU or MoE), each around a residual.

With `hyper_connections.hc_mult` = n > 1 (DeepSeek-V4 report 2.2) the block carries n residual
streams [B, T, n, D]: each sublayer reads their mHC collapse and writes back through its own
mappings (`attn_hc`, `ffn_hc`; model/layers/hyper_connections.py) instead of x + F(norm(x)).
"""

import flax.linen as nn

from model.config import ModelConfig, SHARED_KV_KINDS
from model.inference.kv_cache import KVCacheSpec
from model.layers.attention import Attention
from model.layers.common import dtype_of
from model.layers.ffn import SwiGLU
from model.layers.hyper_connections import HyperConnection, expand_streams
from model.layers.moe import MoE
from model.layers.norm import RMSNorm
from model.layers.shared_kv_attention import SharedKVAttention


class DecoderBlock(nn.Module):
    """x: [B, T, d_model] (or streams [B, T, n, d_model]) -> (same shape, aux). HF names:
    input_layernorm, self_attn, post_attention_layernorm, mlp (dense) or moe (+ shared_expert),
    attn_hc / ffn_hc (mHC). `token_ids` [B, T]: the hash-routed MoE layers' input;
    `routed_experts` [B, T, k]: a replayed expert choice for an MoE block (model/layers/moe.py)."""

    config: ModelConfig
    attention_type: str
    is_moe: bool
    limit: float = 0.0  # routed-expert clamp
    shared_limit: float = 0.0  # dense FFN / shared-expert clamp
    kv_cache: KVCacheSpec | None = None  # incremental decoding (model/inference/)
    is_hash: bool = False  # MoE routed by token id (model/layers/hash_routing.py)
    streams: bool = True  # mHC when hc_mult > 1 (MTP blocks take one stream)

    @nn.compact
    def __call__(self, x, positions, segment_ids, token_ids=None, routed_experts=None):
        cfg = self.config
        norm = dict(eps=cfg.norm_eps, dtype=dtype_of(cfg.compute_dtype),
                    param_dtype=dtype_of(cfg.param_dtype), axis_name="embed")
        input_norm = RMSNorm(name="input_layernorm", **norm)
        ffn_norm = RMSNorm(name="post_attention_layernorm", **norm)

        def attention(h):
            layer = SharedKVAttention if self.attention_type in SHARED_KV_KINDS else Attention
            return layer(cfg, self.attention_type, self.kv_cache, name="self_attn")(
                input_norm(h), positions, segment_ids)

        def ffn(h):
            if self.is_moe:  # padding (segment 0) is no part of a sequence for its balance loss
                return MoE(cfg, self.limit, self.shared_limit, self.is_hash, name="moe")(
                    ffn_norm(h), token_ids, routed_experts,
                    None if segment_ids is None else segment_ids > 0)
            return SwiGLU(cfg, cfg.dense_hidden, self.shared_limit, name="mlp")(ffn_norm(h)), {}

        if self.streams and cfg.hyper_connections.hc_mult > 1:
            hc = cfg.hyper_connections
            options = dict(sinkhorn_iters=hc.sinkhorn_iters, hc_eps=hc.eps, norm_eps=cfg.norm_eps,
                           init_std=cfg.init_std, param_dtype=dtype_of(cfg.param_dtype))
            h, mix = HyperConnection(name="attn_hc", **options)(x)
            attn_out, attn_aux = attention(h)
            x = expand_streams(x, attn_out, mix)
            h, mix = HyperConnection(name="ffn_hc", **options)(x)
            ffn_out, ffn_aux = ffn(h)
            return expand_streams(x, ffn_out, mix), {**attn_aux, **ffn_aux}

        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        attn_out, attn_aux = attention(x)
        x = x + attn_out
        ffn_out, ffn_aux = ffn(x)
        return x + ffn_out, {**attn_aux, **ffn_aux}
