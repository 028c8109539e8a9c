"""Multi-token prediction heads (report 2.2; DeepSeek-V3 style).

Head h (1-based) reads the previous depth's hidden state at position t (the backbone's for
h = 1) and the embedding of token x_{t+h}, and predicts x_{t+1+h}:
    h' = eh_proj([enorm(Emb(x_{t+h})); hnorm(h_prev)])
    h_out = one sliding-window block with a dense FFN (h'): Step 3.5's S, or DeepSeek-V4's W
            (`mtp.attention_type`); plain residuals even in an mHC model, whose heads read
            the collapsed backbone output
    logits = output_head(norm(h_out))
The concatenation order follows the published checkpoints' `eh_proj` layout (embedding half
first); the report writes the two halves the other way round, which only permutes eh_proj's rows.
"""

import flax.linen as nn
import jax.numpy as jnp

from model.config import ModelConfig
from model.inference.kv_cache import KVCacheSpec
from model.layers.block import DecoderBlock
from model.layers.common import dtype_of
from model.layers.norm import RMSNorm
from model.layers.projection import Projection


def shift_tokens_left(tokens, offset: int):
    """[B, T] -> [B, T] with out[:, t] = tokens[:, t + offset] (0 past the end)."""
    return jnp.pad(tokens[:, offset:], ((0, 0), (0, min(offset, tokens.shape[1]))))


class MTPHead(nn.Module):
    """(h_prev [B, T, D], shifted token embeddings [B, T, D]) -> hidden [B, T, D] (pre-norm).

    HF names: enorm, hnorm, eh_proj, the block's own names, transformer.shared_head.norm/.output.
    """

    config: ModelConfig
    kv_cache: KVCacheSpec | None = None

    def setup(self):
        cfg = self.config
        dtype, param_dtype = dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype)
        norm = dict(eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype, axis_name="embed")
        self.enorm = RMSNorm(**norm)
        self.hnorm = RMSNorm(**norm)
        self.eh_proj = Projection((cfg.d_model,), ("mtp_concat", "embed"), 1, cfg.init_std,
                                  dtype, param_dtype)
        self.block = DecoderBlock(cfg, cfg.mtp.attention_type, is_moe=False,
                                  kv_cache=self.kv_cache, streams=False)
        self.norm = RMSNorm(**norm)
        if not cfg.mtp.share_output_head:
            self.output_head = Projection((cfg.vocab_size,), ("embed", "vocab"), 1,
                                          cfg.init_std, dtype, param_dtype)

    def __call__(self, h_prev, next_embeddings, positions, segment_ids):
        h = self.eh_proj(jnp.concatenate([self.enorm(next_embeddings), self.hnorm(h_prev)], -1))
        h, _ = self.block(h, positions, segment_ids)
        return h

    def head_norm(self, h):
        return self.norm(h)

    def own_logits(self, normed):
        return self.output_head(normed)
