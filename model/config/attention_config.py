"""Attention configs: Step 3.5's per-type GQA settings (`AttentionTypeConfig`, layout
characters F and S) and DeepSeek-V4's shared-KV attention (`SharedKVAttentionConfig`, layout
characters W, C and H), with the RoPE context-extension scaling both use.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from model.config.core import (
    Config,
    ConfigError,
    check_choice,
    check_fraction,
    check_int,
    check_positive,
)

ROPE_SCALING_TYPES = ("none", "yarn", "llama3")
# How CSA layers (`C`) attend to their compressed entries: the lightning indexer's top-k
# (sparse, DeepSeek-V4 report §2.3.1) or every visible entry (dense: the report's dense
# pre-training phase and the indexer warm-up, §4.2.2).
CSA_ATTENTION = ("sparse", "dense")
# Step 3.5's head-wise gate (A.1, eq. 5), a learnable per-head sink logit (MiMo-V2-Flash eqs.
# 1-4), or neither.
GATE_TYPES = ("headwise", "sink", "none")


@dataclasses.dataclass(frozen=True)
class RopeScaling(Config):
    """Context-extension scaling of RoPE frequencies: of Step 3.5's full-attention layers
    (`AttentionTypeConfig`) or DeepSeek-V4's compressed layers (`SharedKVAttentionConfig`).

    `type`: `none`, `yarn` (YaRN, NTK-by-parts + attention temperature) or `llama3`.
    `factor`: extension factor; `original_max_len`: the pre-extension context length.
    """

    type: str = "none"
    factor: float = 1.0
    original_max_len: int = 4096
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3

    def validate(self) -> None:
        check_choice("type", self.type, ROPE_SCALING_TYPES)
        if self.type == "none":
            return
        check_positive("factor", self.factor)
        check_int("original_max_len", self.original_max_len, 1)
        if self.type == "yarn" and not self.beta_fast > self.beta_slow > 0:
            raise ConfigError("", "need beta_fast > beta_slow > 0 for yarn")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ConfigError("", "need high_freq_factor > low_freq_factor > 0 for llama3")


@dataclasses.dataclass(frozen=True)
class AttentionTypeConfig(Config):
    """Per-attention-type settings of the GQA layers F and S (report Table 6: 64 query heads
    full / 96 SWA). The geometry fields left at None take the model's values (`num_kv_heads`,
    `head_dim`, `v_head_dim`, `gate`), so Step 3.5 presets name them once; MiMo-V2-Flash sets them per type
    (4 KV heads full / 8 SWA, Q/K heads of 192 dims with 128-dim values, the sink on SWA layers
    only). `ModelConfig.attention_geometry` resolves them and checks their fit."""

    num_heads: int = 64
    rope_theta: float = 10_000.0
    # RoPE rotates the leading int(partial_rotary_factor * head_dim) dims, as the releases
    # compute it (MiMo-V2-Flash: int(0.334 * 192) = 64).
    partial_rotary_factor: float = 1.0
    rope_scaling: RopeScaling = RopeScaling()
    num_kv_heads: int | None = None
    head_dim: int | None = None  # of queries and keys
    v_head_dim: int | None = None  # None: the model's, else this type's query/key head dim
    gate: str | None = None  # headwise / sink / none; None: the model's `gate`

    def validate(self) -> None:
        check_int("num_heads", self.num_heads, 1)
        check_positive("rope_theta", self.rope_theta)
        check_fraction("partial_rotary_factor", self.partial_rotary_factor)
        for name in ("num_kv_heads", "head_dim", "v_head_dim"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        if self.gate is not None:
            check_choice("gate", self.gate, GATE_TYPES)


@dataclasses.dataclass(frozen=True)
class AttentionGeometry:
    """One GQA layer type's resolved shape (`ModelConfig.attention_geometry`)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int  # queries and keys
    v_head_dim: int
    rotary_dims: int  # leading dims of each query/key head that RoPE rotates
    gate: str  # headwise / sink / none
    rope_theta: float
    rope_scaling: RopeScaling


def resolve_geometry(type_cfg: AttentionTypeConfig, num_kv_heads: int, head_dim: int,
                     v_head_dim: int | None, gate: str) -> AttentionGeometry:
    """`type_cfg` with its unset fields taken from the model's; raises `ConfigError` where GQA
    needs whole groups of query heads or rotate-half RoPE an even number of dims."""
    kv_heads = type_cfg.num_kv_heads or num_kv_heads
    qk_dim = type_cfg.head_dim or head_dim
    if type_cfg.num_heads % kv_heads:
        # Name the type's own num_kv_heads when it set one, else its num_heads (the model's
        # num_kv_heads serves every type).
        raise ConfigError("num_kv_heads" if type_cfg.num_kv_heads else "num_heads",
                          f"{type_cfg.num_heads} query heads are not divisible by "
                          f"num_kv_heads={kv_heads} (GQA needs whole groups)")
    rotary_dims = int(type_cfg.partial_rotary_factor * qk_dim)
    if rotary_dims % 2:
        raise ConfigError("partial_rotary_factor", f"{type_cfg.partial_rotary_factor} * "
                          f"head_dim={qk_dim} gives {rotary_dims} rotary dims; rotate-half RoPE "
                          "needs an even number")
    return AttentionGeometry(
        num_heads=type_cfg.num_heads, num_kv_heads=kv_heads, head_dim=qk_dim,
        v_head_dim=type_cfg.v_head_dim or v_head_dim or qk_dim, rotary_dims=rotary_dims,
        gate=type_cfg.gate or gate, rope_theta=type_cfg.rope_theta,
        rope_scaling=type_cfg.rope_scaling)


@dataclasses.dataclass(frozen=True)
class SharedKVAttentionConfig(Config):
    """DeepSeek-V4's attention (report §2.3; defaults are V4-Flash's, Hugging Face's
    `DeepseekV4Config`): shared-KV MQA (one KV entry is key and value) with a low-rank query,
    partial RoPE on the trailing `rope_dims` channels, a per-head sink and the grouped low-rank
    output projection; in layers `W` that alone over the sliding window (`ModelConfig.window`),
    in `C` (CSA, eqs. 9-17) plus overlapped compression by `csa_rate` and the lightning
    indexer's top-`index_topk` selection, in `H` (HCA, eqs. 20-26) plus dense attention over
    entries compressed by `hca_rate`.

    RoPE: `W` layers use `rope_theta`; `C`/`H` layers (queries, window and compressed entries
    alike) `compress_rope_theta` with `compress_rope_scaling` (the release's YaRN, whose
    attention-temperature multiplier upstream leaves out)."""

    section = "shared_kv_attention"

    num_heads: int = 64
    head_dim: int = 512
    rope_dims: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    rope_theta: float = 10_000.0
    compress_rope_theta: float = 160_000.0
    compress_rope_scaling: RopeScaling = RopeScaling()
    csa_rate: int = 4
    hca_rate: int = 128
    index_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # `sparse`: the top-`index_topk` entries; `dense`: all visible entries, the indexer trained
    # on the dense distribution (model.ops.sparse_indexer.dense_indexer_terms). Parameters are
    # the same, so a staged recipe switches it between stages.
    csa_attention: str = "sparse"
    query_chunk: int = 128  # query rows per chunk of the core attention and the indexer

    def validate(self) -> None:
        for name in ("num_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                     "csa_rate", "hca_rate", "index_heads", "index_head_dim", "index_topk",
                     "query_chunk"):
            check_int(name, getattr(self, name), 1)
        check_int("rope_dims", self.rope_dims, 0)
        check_choice("csa_attention", self.csa_attention, CSA_ATTENTION)
        for name in ("rope_theta", "compress_rope_theta"):
            check_positive(name, getattr(self, name))
        if self.rope_dims % 2 or self.rope_dims > min(self.head_dim, self.index_head_dim):
            raise ConfigError("rope_dims", f"{self.rope_dims} must be even and at most head_dim="
                              f"{self.head_dim} and index_head_dim={self.index_head_dim}")
        if self.num_heads % self.o_groups:
            raise ConfigError("o_groups", f"{self.o_groups} does not divide num_heads="
                              f"{self.num_heads} (each output group holds whole heads)")


def _given_size(given: Mapping[str, Any], name: str) -> int | None:
    """A size the config sets itself (a bad value is left for validation to name)."""
    value = given.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def host_shared_kv_sizes(given: Mapping[str, Any], d_model: int,
                         host: AttentionGeometry) -> dict[str, int]:
    """The parameter sizes of DeepSeek-V4's attention that a config leaves out (`given`: its
    `shared_kv_attention` values), scaled to the model it is added to, whose full-attention
    geometry is `host`: query heads as the host's, head dim 4x the host's query/key head dim
    (one shared-KV MQA entry serves every head), the host's rotary dims, query and output
    low-rank dims d_model / 4, gcd(heads, 8) output groups, an indexer of as many heads of the
    host's head dim. On Step 3.5 Flash (d_model 4096, 64 heads of 128, 64 rotary dims) this is
    exactly V4-Flash's geometry (64 x 512, 64, 1024, 8 groups, indexer 64 x 128), the dataclass
    defaults; on the tiny preset CSA layers stay tiny instead of taking V4-Flash's sizes.
    -> {field: size} for the fields `given` leaves out."""
    heads = _given_size(given, "num_heads") or host.num_heads
    head_dim = _given_size(given, "head_dim") or 4 * host.head_dim
    index_dim = _given_size(given, "index_head_dim") or host.head_dim
    low_rank = max(1, d_model // 4)
    sizes = {"num_heads": heads, "head_dim": head_dim, "index_head_dim": index_dim,
             "rope_dims": min(host.rotary_dims, head_dim, index_dim) // 2 * 2,
             "q_lora_rank": low_rank, "o_lora_rank": low_rank, "o_groups": math.gcd(heads, 8),
             "index_heads": heads}
    return {name: size for name, size in sizes.items() if name not in given}
