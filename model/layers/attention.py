"""Attention layer: GQA with per-head QK norm, partial RoPE, and head-wise gate / sink / none.

Report 2.2 and A.1: full layers use 64 query heads, SWA layers 96 ("+Head"), 8 KV heads.
Head-wise gate (eq. 5): g_i = sigmoid(w_gate · x_i) per head, multiplied into the head's output
before o_proj; eq. 6 shows it equals an input-dependent sink mass exp(-g_i) Z_i.
MiMo-V2-Flash: per-type geometry (KV heads, Q/K head dim, a smaller V head dim), the learnable
per-head sink bias (its eqs. 1-4) on SWA layers, values scaled by `value_scale`
(`ModelConfig.attention_geometry`).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from model.config import ModelConfig
from model.inference.kv_cache import (
    KVCacheSpec,
    attend_and_update,
    cache_variables,
    empty_layer_cache,
)
from model.layers.common import dtype_of
from model.layers.norm import RMSNorm
from model.layers.projection import Projection
from model.layers.rope import apply_rope
from model.ops.tables import ATTENTION
from model.parallel.context import context_layout, splits_sequences
from model.parallel.context_attention import context_attention
from model.parallel.mesh import mesh_size, shard_attention_core


class Attention(nn.Module):
    """x: [B, T, d_model], positions/segment_ids: [B, T] -> ([B, T, d_model], aux).

    With `kv_cache` set the layer decodes incrementally (model/inference/kv_cache.py): `positions`
    are absolute (-1 marks padding), `segment_ids` is unused, and the keys/values live in the
    mutable `cache` collection."""

    config: ModelConfig
    attention_type: str  # "F" full causal or "S" sliding window
    kv_cache: KVCacheSpec | None = None

    @nn.compact
    def __call__(self, x, positions, segment_ids):
        cfg = self.config
        geo = cfg.attention_geometry(self.attention_type)
        heads, kv_heads = geo.num_heads, geo.num_kv_heads
        dtype, param_dtype = dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype)

        def projection(name, features, axes, contract=1):
            return Projection(tuple(features), axes, contract, cfg.init_std, dtype, param_dtype,
                              name=name)

        q = projection("q_proj", (heads, geo.head_dim), ("embed", "heads", "head_dim"))(x)
        k = projection("k_proj", (kv_heads, geo.head_dim), ("embed", "kv_heads", "head_dim"))(x)
        v = projection("v_proj", (kv_heads, geo.v_head_dim), ("embed", "kv_heads", "head_dim"))(x)
        if cfg.value_scale != 1.0:
            v = v * jnp.asarray(cfg.value_scale, v.dtype)
        if cfg.qk_norm:
            norm = dict(eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype, axis_name="head_dim")
            q = RMSNorm(name="q_norm", **norm)(q)
            k = RMSNorm(name="k_norm", **norm)(k)
        # RoPE scaling applies to full layers only (config validation enforces it for SWA).
        q = apply_rope(q, positions, geo.rotary_dims, geo.rope_theta, geo.rope_scaling)
        k = apply_rope(k, positions, geo.rotary_dims, geo.rope_theta, geo.rope_scaling)

        sink = None
        if geo.gate == "sink":
            sink = self.param(
                "sink", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("heads",)),
                (heads,), param_dtype,
            )
        window = cfg.window if self.attention_type == "S" else None
        if self.kv_cache is not None:
            y = self._cached_attention(q, k, v, positions, window, sink, geo.rotary_dims)
        else:
            core = ATTENTION.resolve(cfg.attention_impl)
            if splits_sequences(self):  # the sequence is split: exchange what crosses
                core = context_attention(core, context_layout(cfg))
            elif cfg.attention_impl == "pallas" and mesh_size() > 1:
                core = shard_attention_core(core)  # XLA does not partition a pallas_call
            y = core(q, k, v, window=window, segment_ids=segment_ids, sink=sink)  # [B, T, H, Dv]

        aux = {}
        if geo.gate == "headwise":
            gate_logits = projection("g_proj", (heads,), ("embed", "heads"))(x)
            gate = jax.nn.sigmoid(gate_logits.astype(jnp.float32))  # [B, T, H], eq. 5
            y = (y.astype(jnp.float32) * gate[..., None]).astype(dtype)
            aux["gate_mean"] = jax.lax.stop_gradient(jnp.mean(gate, axis=(0, 1)))
        out = projection("o_proj", (cfg.d_model,), ("heads", "head_dim", "embed"), contract=2)(y)
        return checkpoint_name(out, "attention_out"), aux

    def _cached_attention(self, q, k, v, positions, window, sink, rotary_dims):
        """Attends over this layer's cache plus the chunk and writes the chunk into the cache."""
        batch, _, kv_heads, head_dim = k.shape
        # keys' leading RoPE channels kept as computed under `fp8`; values have none
        formats = (self.kv_cache.row_format((0, rotary_dims)), self.kv_cache.row_format())
        cache, store = cache_variables(self, empty_layer_cache(
            batch, self.kv_cache.slots(window), kv_heads, head_dim,
            dtype_of(self.config.compute_dtype), v_head_dim=v.shape[-1], formats=formats))
        y, updated = attend_and_update(q, k, v, positions, cache, window=window, sink=sink,
                                       formats=formats)
        store(updated)
        return y
