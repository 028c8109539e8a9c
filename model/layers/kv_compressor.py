"""The learned parts of DeepSeek-V4's compressed layers: the KV compressor of CSA / HCA
(report §2.3.1 eqs. 9-12, §2.3.2 eqs. 20-23) and CSA's lightning indexer (eqs. 13-17).
The arithmetic is in `model.ops.kv_compression` and `model.ops.sparse_indexer`.

Parameter names are the Hugging Face checkpoint's (`self_attn.compressor.*`,
`self_attn.compressor.indexer.*`); kernels are stored [in, out]. The compressors' `kv_norm` is a
zero-centred offset like every stepjax norm weight (applied as 1 + w).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.inference.compressed_cache import cached_compression, entry_ends
from model.inference.kv_cache import KVCacheSpec
from model.layers.common import dtype_of, normal_init
from model.ops.kv_compression import CompressedKV, CompressorParams, compress_kv
from model.ops.sparse_indexer import (
    DenseIndexerTerms,
    Selection,
    dense_indexer_terms,
    fp4_qk,
    indexer_head_weights,
    indexer_queries,
    select_entries,
)
from model.parallel.context import context_layout, splits_sequences
from model.parallel.context_compression import (
    context_compress,
    context_dense_indexer_terms,
    context_select_entries,
)


QK_FORMATS = {"none": lambda x: x, "mxfp4": fp4_qk}


class Compressor(nn.Module):
    """hidden [B, T, d] -> CompressedKV of `width`-channel entries, one per `rate` tokens;
    `overlap` for CSA's two interleaved series (projections [d, 2·width])."""

    config: ModelConfig
    width: int
    rate: int
    overlap: bool

    def setup(self):
        cfg = self.config
        out = 2 * self.width if self.overlap else self.width
        param_dtype = dtype_of(cfg.param_dtype)
        self.kv_proj = self.param("kv_proj", normal_init(cfg.init_std, ("embed", "kv_lora")),
                                  (cfg.d_model, out), param_dtype)
        self.gate_proj = self.param("gate_proj", normal_init(cfg.init_std, ("embed", "kv_lora")),
                                    (cfg.d_model, out), param_dtype)
        # The learned slot bias B of eqs. 11 / 22; upstream initialises it to 0.
        self.position_bias = self.param(
            "position_bias",
            nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                         ("compress_slot", "kv_lora")),
            (self.rate, out), param_dtype)
        self.kv_norm = self.param(
            "kv_norm", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("norm",)),
            (self.width,), param_dtype)

    def params(self) -> CompressorParams:
        return CompressorParams(self.kv_proj, self.gate_proj, self.position_bias,
                                1.0 + self.kv_norm.astype(jnp.float32))

    def __call__(self, hidden, segment_ids, positions, inv_freq) -> CompressedKV:
        """positions [B, T]: the RoPE positions the queries use (model.ops.kv_compression).
        Under `mesh.context` the entries of every shard, whole on each."""
        options = dict(rate=self.rate, overlap=self.overlap, inv_freq=inv_freq,
                       segment_ids=segment_ids, positions=positions, eps=self.config.norm_eps)
        if splits_sequences(self):
            return context_compress(hidden, self.params(), layout=context_layout(self.config),
                                    **options)
        return compress_kv(hidden, self.params(), **options)


class LightningIndexer(nn.Module):
    """CSA's top-k selection (eqs. 13-17): its own overlapped compressor of width c^I, queries
    from the shared query latent, per-head weights from the hidden state. With `kv_cache` the
    keys come from the indexer's decode cache (model/inference/compressed_cache.py) and
    `positions` are absolute (-1 = padding).

    As DeepSeek-V3.2's indexer (the recipe the indexer loss follows), its inputs are detached:
    it learns only from its own loss, and the main model gets no gradient through it."""

    config: ModelConfig
    kv_cache: KVCacheSpec | None = None

    @nn.compact
    def __call__(self, hidden, q_latent, positions, segment_ids, inv_freq,
                 dense_target=None) -> Selection | DenseIndexerTerms:
        """hidden [B, T, d], q_latent [B, T, q_lora_rank], positions / segment_ids [B, T]
        (segment_ids None: one document per row) -> Selection of [B, T, index_topk]; with
        `dense_target` [B, T, T // csa_rate] (a dense C layer's attention probability of each
        entry summed over heads) instead the warm-up loss and recall against it."""
        cfg, attn = self.config, self.config.shared_kv_attention
        dtype, param_dtype = dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype)
        hidden, q_latent = jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(q_latent)
        compressor = Compressor(cfg, attn.index_head_dim, attn.csa_rate, overlap=True,
                                name="compressor")
        q_b_proj = self.param("q_b_proj", normal_init(cfg.init_std, ("q_lora", "index_heads")),
                              (attn.q_lora_rank, attn.index_heads * attn.index_head_dim),
                              param_dtype)
        weights_proj = self.param("weights_proj", normal_init(cfg.init_std,
                                                              ("embed", "index_heads")),
                                  (cfg.d_model, attn.index_heads), param_dtype)
        batch, length, _ = hidden.shape
        queries = indexer_queries(q_latent.astype(dtype), q_b_proj, positions, inv_freq,
                                  num_heads=attn.index_heads)
        head_weights = indexer_head_weights(hidden.astype(dtype), weights_proj)
        # FP4 QAT of the QK path (report §3.4): the decode cache holds the keys unquantized
        # and they are quantized as they are read, which is what an FP4 cache would return
        quantize = QK_FORMATS[cfg.qat.indexer_qk]
        queries = quantize(queries)
        options = dict(top_k=attn.index_topk, chunk_size=attn.query_chunk,
                       score_dtype=jnp.dtype(cfg.qat.index_scores))
        if self.kv_cache is not None:
            keys = cached_compression(self, compressor.params(), hidden, positions,
                                      self.kv_cache, rate=attn.csa_rate, overlap=True,
                                      inv_freq=inv_freq, eps=cfg.norm_eps)
            return select_entries(queries, head_weights, quantize(keys.entries), positions,
                                  entry_ends(keys), **options)
        keys = compressor(hidden, segment_ids, positions, inv_freq)
        entries = quantize(keys.entries)
        if splits_sequences(self):  # each shard scores its queries against every key
            split = dict(layout=context_layout(cfg), **options)
            keys = keys._replace(entries=entries)
            if dense_target is not None:
                return context_dense_indexer_terms(queries, head_weights, keys, dense_target,
                                                   segment_ids, **split)
            return context_select_entries(queries, head_weights, keys, segment_ids, **split)
        token_index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        placement = dict(query_segment_ids=segment_ids, entry_segment_ids=keys.segment_ids,
                         **options)
        if dense_target is not None:
            return dense_indexer_terms(queries, head_weights, entries, dense_target,
                                       token_index, keys.last_token, **placement)
        return select_entries(queries, head_weights, entries, token_index, keys.last_token,
                              **placement)
