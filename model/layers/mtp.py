"""Multi-token prediction heads (report 2.2; DeepSeek-V3 style).

Head h (1-based) reads the previous depth's hidden state at position t (the backbone's for
h = 1) and the embedding of token x_{t+h}, and predicts x_{t+1+h}. Two builds (`mtp.block`):

`dense` (Step 3.5, DeepSeek-V3):
    h' = eh_proj([enorm(Emb(x_{t+h})); hnorm(h_prev)])
    h_out = one sliding-window block with a dense FFN (h'): Step 3.5's S, or DeepSeek-V4's W
            (`mtp.attention_type`); plain residuals even in an mHC model, whose heads read
            the collapsed backbone output
    logits = output_head(norm(h_out))
The concatenation order follows the published checkpoints' `eh_proj` layout (embedding half
first); the report writes the two halves the other way round, which only permutes eh_proj's rows.

`layer` (DeepSeek-V4's release, `MTPBlock` of its inference code): h_prev is the n mHC streams
[B, T, n, D] before the backbone's hc_head, and the block is a full decoder layer of the model
(attention `mtp.attention_type`, routed MoE with learned routing, mHC):
    H' = e_proj(enorm(Emb(x_{t+h}))) + h_proj(hnorm(H_prev))   (the embedding into every stream)
    H_out = decoder layer (H')
    logits = output_head(norm(hc_head(H_out)))                 (the head's own hc_head and norm)
e_proj + h_proj is eh_proj split in its two halves, computed once for the embedding rather than
once per stream. The release shares the output head (`mtp.share_output_head`).
"""

import flax.linen as nn
import jax.numpy as jnp

from model.config import ModelConfig
from model.inference.kv_cache import KVCacheSpec
from model.layers.common import dtype_of
from model.layers.hyper_connections import HyperHead
from model.layers.norm import RMSNorm
from model.layers.projection import Projection
from model.layers.stack import block_class


def shift_tokens_left(tokens, offset: int):
    """[B, T] -> [B, T] with out[:, t] = tokens[:, t + offset] (0 past the end)."""
    return jnp.pad(tokens[:, offset:], ((0, 0), (0, min(offset, tokens.shape[1]))))


def reads_streams(cfg: ModelConfig) -> bool:
    """Whether the MTP heads take (and pass on) the mHC streams [B, T, n, D] as h_prev."""
    return cfg.mtp.block == "layer" and cfg.hyper_connections.hc_mult > 1


class MTPHead(nn.Module):
    """(h_prev [B, T, D] or streams [B, T, n, D] (`reads_streams`), shifted token embeddings
    [B, T, D]) -> (hidden of h_prev's shape (pre-norm), the block's aux).

    HF names: enorm, hnorm, eh_proj (or e_proj / h_proj), the block's own names, hc_head,
    transformer.shared_head.norm/.output.
    """

    config: ModelConfig
    kv_cache: KVCacheSpec | None = None

    def setup(self):
        cfg = self.config
        dtype, param_dtype = dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype)
        norm = dict(eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype, axis_name="embed")
        projection = dict(features=(cfg.d_model,), axes=("mtp_concat", "embed"), contract=1,
                          std=cfg.init_std, dtype=dtype, param_dtype=param_dtype)
        self.enorm = RMSNorm(**norm)
        self.hnorm = RMSNorm(**norm)
        layer = cfg.mtp.block == "layer"
        if layer:
            self.e_proj = Projection(**projection)
            self.h_proj = Projection(**projection)
        else:
            self.eh_proj = Projection(**projection)
        # A full layer's clamps are the last decoder layer's (DeepSeek-V4 has one for all); the
        # dense block is unclamped, as Step 3.5's checkpoint has it.
        limits = (cfg.swiglu_limits[-1], cfg.swiglu_limits_shared[-1]) if layer else (0.0, 0.0)
        # rematerialised like the decoder layers (model.remat_policy): under differentiation
        # the block keeps what the policy saves, not every intermediate of its batch
        self.block = block_class(cfg, in_loop=False)(
            cfg, cfg.mtp.attention_type, is_moe=layer, limit=limits[0], shared_limit=limits[1],
            kv_cache=self.kv_cache, streams=layer)
        if reads_streams(cfg):
            hc = cfg.hyper_connections
            self.hc_head = HyperHead(hc_eps=hc.eps, norm_eps=cfg.norm_eps, init_std=cfg.init_std,
                                     param_dtype=param_dtype)
        self.norm = RMSNorm(**norm)
        if not cfg.mtp.share_output_head:
            self.output_head = Projection((cfg.vocab_size,), ("embed", "vocab"), 1,
                                          cfg.init_std, dtype, param_dtype)

    def __call__(self, h_prev, next_embeddings, positions, segment_ids):
        if self.config.mtp.block == "layer":
            embedded = self.e_proj(self.enorm(next_embeddings))
            h = self.h_proj(self.hnorm(h_prev))
            h = h + (embedded[:, :, None] if h.ndim == 4 else embedded)
        else:
            h = self.eh_proj(jnp.concatenate([self.enorm(next_embeddings), self.hnorm(h_prev)],
                                             -1))
        return self.block(h, positions, segment_ids)

    def head_norm(self, h):
        """The head's hidden state (or streams) -> normed [B, T, D] for the output head."""
        return self.norm(self.hc_head(h) if reads_streams(self.config) else h)

    def own_logits(self, normed):
        return self.output_head(normed)
