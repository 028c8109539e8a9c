"""DeepSeek-V4's attention layers (report §2.3): layout characters W (sliding window only),
C (CSA) and H (HCA), all on one shared-KV MQA core.

    c^Q = RMSNorm(x W^DQ)                         low-rank query latent (eq. 13's c^Q)
    q   = RoPE(RMSNorm_h(c^Q W^UQ))               per-head weightless norm
    kv  = RoPE(RMSNorm(x W^KV))                   one entry per token: key and value
    o   = Attn(q; window kv, compressed entries; sink)    model.ops.compressed_attention
    y   = W^OB · concat_g(W^OA_g · RoPE^-1(o)_g)  grouped low-rank output (§2.3.1)

RoPE is interleaved on the trailing `rope_dims` channels (model.ops.interleaved_rope); because
K = V the output carries the entries' absolute positions, so its rope channels are rotated
back by the query position (§2.3.3). Compressed layers add entries from the `Compressor`
(every `hca_rate` tokens for H; overlapped every `csa_rate` for C, of which the lightning
indexer selects `index_topk` per query). Layers W use `rope_theta`; C and H
`compress_rope_theta` with `compress_rope_scaling`, for queries, window and entries alike,
without YaRN's attention-temperature multiplier (as transformers' DeepseekV4Attention).

Parameter names follow the Hugging Face checkpoint (`self_attn.q_a_proj`, `q_a_norm`,
`q_b_proj`, `kv_proj`, `kv_norm`, `o_a_proj`, `o_b_proj`, `sinks`, `compressor.*`).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from model.config import ModelConfig, RopeScaling
from model.inference.compressed_cache import (
    cached_compression,
    empty_window_cache,
    entry_visibility,
    window_keys,
)
from model.inference.kv_cache import KVCacheSpec, cache_variables
from model.layers.common import dtype_of, normal_init
from model.layers.kv_compressor import Compressor, LightningIndexer
from model.layers.norm import RMSNorm
from model.layers.projection import Projection
from model.layers.rope import rope_frequencies
from model.ops.compressed_attention import attend_window_and_entries, compressed_attention
from model.ops.interleaved_rope import rotate_trailing_pairs
from model.ops.kv_compression import CompressedKV
from model.ops.sparse_indexer import indexer_kl_loss
from model.parallel.context import context_layout, splits_sequences
from model.parallel.context_compression import context_compressed_attention


def rope_inv_freq(cfg: ModelConfig, attention_type: str) -> np.ndarray:
    """[rope_dims / 2] inverse frequencies of layer character W, C or H."""
    attn = cfg.shared_kv_attention
    if attention_type == "W":
        return rope_frequencies(attn.rope_dims, attn.rope_theta, RopeScaling())[0]
    return rope_frequencies(attn.rope_dims, attn.compress_rope_theta,
                            attn.compress_rope_scaling)[0]


def no_entries(batch: int, width: int, dtype) -> CompressedKV:
    """The empty compressed set of a W layer: [B, 0, width]."""
    return CompressedKV(jnp.zeros((batch, 0, width), dtype), jnp.zeros((batch, 0), jnp.int32),
                        jnp.zeros((batch, 0), jnp.int32))


class SharedKVAttention(nn.Module):
    """x: [B, T, d_model], positions / segment_ids: [B, T] -> ([B, T, d_model], aux).

    aux of a C layer: `indexer_loss`, the KL of the indexer's scores from the main attention's
    probabilities over the selected entries (model.ops.sparse_indexer.indexer_kl_loss), the
    indexer's only training signal; with `csa_attention: dense` the layer attends to every
    visible entry and the KL covers them all (`dense_indexer_terms`), with the indexer's top-k
    recall against the dense attention (`indexer_recall_hits` / `indexer_recall_slots`).

    With `kv_cache` set the layer decodes incrementally (model/inference/compressed_cache.py):
    `positions` are absolute (-1 marks padding), `segment_ids` is unused, the window ring and
    the compressed entries live in the mutable `cache` collection, and aux is empty."""

    config: ModelConfig
    attention_type: str  # "W", "C" or "H"
    kv_cache: KVCacheSpec | None = None  # incremental decoding (model/inference/compressed_cache.py)

    @nn.compact
    def __call__(self, x, positions, segment_ids):
        cfg, attn = self.config, self.config.shared_kv_attention
        dtype, param_dtype = dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype)
        norm = dict(eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)
        batch, length, _ = x.shape

        def projection(name, features, axes, contract=1):
            return Projection(tuple(features), axes, contract, cfg.init_std, dtype, param_dtype,
                              name=name)

        inv_freq = jnp.asarray(rope_inv_freq(cfg, self.attention_type), jnp.float32)
        q_latent = RMSNorm(name="q_a_norm", axis_name="q_lora", **norm)(
            projection("q_a_proj", (attn.q_lora_rank,), ("embed", "q_lora"))(x))
        q = projection("q_b_proj", (attn.num_heads, attn.head_dim),
                       ("q_lora", "heads", "head_dim"))(q_latent)
        q32 = q.astype(jnp.float32)
        q = (q32 * jax.lax.rsqrt(jnp.mean(q32 * q32, -1, keepdims=True) + cfg.norm_eps)).astype(dtype)
        q = rotate_trailing_pairs(q, positions, inv_freq)
        kv = RMSNorm(name="kv_norm", axis_name="head_dim", **norm)(
            projection("kv_proj", (attn.head_dim,), ("embed", "head_dim"))(x))
        kv = rotate_trailing_pairs(kv, positions, inv_freq)
        sinks = self.param("sinks", nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                                 ("heads",)),
                           (attn.num_heads,), param_dtype)

        aux = {}
        if self.kv_cache is not None:
            y = self._cached_attention(x, q, kv, q_latent, positions, sinks, inv_freq)
        elif self.attention_type == "W":
            y = self._attend(q, kv, no_entries(batch, attn.head_dim, dtype), sinks, segment_ids)
        else:
            compressed = self._compressor()(x, segment_ids, positions, inv_freq)
            if self.attention_type == "H":
                y = self._attend(q, kv, compressed, sinks, segment_ids)
            elif attn.csa_attention == "dense":  # every visible entry; the indexer learns it
                y, entry_probs = self._attend(q, kv, compressed, sinks, segment_ids,
                                              entry_probs=True)
                terms = LightningIndexer(cfg, name="indexer")(x, q_latent, positions,
                                                              segment_ids, inv_freq,
                                                              dense_target=entry_probs)
                aux.update(indexer_loss=terms.loss, indexer_recall_hits=terms.recall_hits,
                           indexer_recall_slots=terms.recall_slots)
            else:
                selection = LightningIndexer(cfg, name="indexer")(x, q_latent, positions,
                                                                  segment_ids, inv_freq)
                y, entry_probs = self._attend(
                    q, kv, compressed, sinks, segment_ids, entry_probs=True,
                    selected=jnp.where(selection.valid, selection.indices, -1))
                aux["indexer_loss"] = indexer_kl_loss(entry_probs[:, :, None], selection.scores,
                                                      selection.valid)
        y = rotate_trailing_pairs(y, -positions, inv_freq)  # §2.3.3: undo the entries' RoPE

        groups = attn.o_groups
        grouped = y.reshape(batch, length, groups, -1)  # heads g·(H/g)+j -> group g
        o_a = self.param("o_a_proj", normal_init(cfg.init_std, ("o_groups", "o_group_in", "o_lora")),
                         (groups, grouped.shape[-1], attn.o_lora_rank), param_dtype)
        mixed = jnp.einsum("btgi,gio->btgo", grouped, o_a.astype(dtype))
        out = projection("o_b_proj", (cfg.d_model,), ("o_groups", "o_lora", "embed"),
                         contract=2)(mixed)
        return checkpoint_name(out, "attention_out"), aux

    def _core_options(self, segment_ids) -> dict:
        return dict(window=self.config.window, segment_ids=segment_ids,
                    query_chunk=self.config.shared_kv_attention.query_chunk)

    def _attend(self, q, kv, compressed, sinks, segment_ids, **kwargs):
        """The core attention (model.ops.compressed_attention), per `mesh.context` shard when
        the sequence is split."""
        options = dict(self._core_options(segment_ids), **kwargs)
        if splits_sequences(self):
            return context_compressed_attention(q, kv, compressed, sinks,
                                                layout=context_layout(self.config), **options)
        return compressed_attention(q, kv, compressed, sinks, **options)

    def _compressor(self) -> Compressor:
        attn = self.config.shared_kv_attention
        csa = self.attention_type == "C"
        return Compressor(self.config, attn.head_dim, attn.csa_rate if csa else attn.hca_rate,
                          overlap=csa, name="compressor")

    def _cached_attention(self, x, q, kv, q_latent, positions, sinks, inv_freq):
        """Decoding: the chunk (positions [B, T] absolute, -1 = padding) attends over the
        window ring and the compressed entries of this layer's caches
        (model/inference/compressed_cache.py), which it extends. -> [B, T, H, c]."""
        cfg, attn, spec = self.config, self.config.shared_kv_attention, self.kv_cache
        batch = x.shape[0]
        fmt = spec.row_format((attn.head_dim - attn.rope_dims, attn.head_dim))  # trailing RoPE
        cache, store = cache_variables(self, empty_window_cache(batch, spec, cfg.window,
                                                                attn.head_dim, kv.dtype, fmt))
        keys, window_mask, cache = window_keys(cache, kv, positions, cfg.window, fmt)
        store(cache)
        if self.attention_type == "W":
            entries = jnp.zeros((batch, 0, attn.head_dim), kv.dtype)
            return attend_window_and_entries(q, keys, window_mask, entries,
                                             jnp.zeros((*positions.shape, 0), bool), sinks)[0]
        csa = self.attention_type == "C"
        compressed = cached_compression(
            self, self._compressor().params(), x, positions, spec,
            rate=attn.csa_rate if csa else attn.hca_rate, overlap=csa, inv_freq=inv_freq,
            eps=cfg.norm_eps, entry_format=fmt)
        selected = None
        if csa and attn.csa_attention == "sparse":  # top-k among the visible cached entries
            selection = LightningIndexer(cfg, spec, name="indexer")(x, q_latent, positions, None,
                                                                   inv_freq)
            selected = jnp.where(selection.valid, selection.indices, -1)
        return attend_window_and_entries(q, keys, window_mask,
                                         fmt.decode(compressed.entries, kv.dtype),
                                         entry_visibility(compressed, positions), sinks,
                                         selected)[0]
