"""`ModelConfig`: everything that defines the network, one frozen dataclass tree validated on
construction (model/config/core.py). Defaults are Step 3.5 Flash (report Table 6).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from model.config.core import (
    Config,
    ConfigError,
    check_bool,
    check_choice,
    check_int,
    check_positive,
)
from model.config.attention_config import (
    GATE_TYPES,
    AttentionGeometry,
    AttentionTypeConfig,
    SharedKVAttentionConfig,
    resolve_geometry,
)
from model.config.mtp_config import MTPConfig
from model.config.qat_config import QATConfig
from model.ops.swiglu import GATE_CLAMPS
from model.ops.tables import ATTENTION, MOE

ROUTER_ACTIVATIONS = ("sigmoid", "softmax", "sqrt_softplus")  # sqrt_softplus: DeepSeek-V4
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots", "dots_with_kernels", "save_attention_out",
                  "save_ffn_out")
EP_COLLECTIVES = ("auto", "ragged", "padded")
CONTEXT_LAYOUTS = ("auto", "contiguous", "balanced")  # model/parallel/context.py
INT32_MAX = 2**31 - 1
# Far beyond any model (the largest have ~100 layers); bounds what per-layer lists a config
# (or a checkpoint's config.json) makes us build.
MAX_LAYERS = 10_000

# One character per layer: Step 3.5's GQA attention, full (F) or sliding-window (S), or
# DeepSeek-V4's shared-KV attention, sliding-window only (W), CSA (C) or HCA (H).
GQA_KINDS, SHARED_KV_KINDS = "FS", "WCH"
_LAYOUT_TERM = re.compile(rf"^([{GQA_KINDS}{SHARED_KV_KINDS}]+)(?:\*(\d+))?$")


def expand_layout(layout: str) -> str:
    """Expands the layout shorthand: `F+SSSF*2` -> `FSSSFSSSF`, `WW+CH*2` -> `WWCHCH`.

    Terms are joined with `+`; each term is a run of layer characters optionally repeated
    with `*N`.
    """
    if not isinstance(layout, str):
        raise ConfigError("layout", f"must be a string of layer characters such as "
                                    f"'F+SSSF*11', got {layout!r}")
    compact = layout.replace(" ", "").upper()
    if not compact:
        raise ConfigError("layout", "must not be empty")
    expanded = []
    for term in compact.split("+"):
        match = _LAYOUT_TERM.match(term)
        if match is None:
            raise ConfigError(
                "layout", f"cannot parse term {term!r} in {layout!r}; use runs of 'F' (full) and "
                "'S' (sliding window) GQA layers or 'W' (sliding window), 'C' (CSA) and 'H' "
                "(HCA) shared-KV layers, joined by '+', each optionally repeated with '*N', "
                "e.g. 'F+SSSF*11' or 'WW+CH*20+C'"
            )
        unit, repeat = match.group(1), int(match.group(2) or 1)
        if repeat < 1:
            raise ConfigError("layout", f"repeat count in {term!r} must be >= 1")
        if sum(map(len, expanded)) + len(unit) * repeat > MAX_LAYERS:
            raise ConfigError("layout", f"{layout!r} expands to more than {MAX_LAYERS} layers")
        expanded.append(unit * repeat)
    return "".join(expanded)


@dataclasses.dataclass(frozen=True)
class HyperConnectionConfig(Config):
    """Manifold-constrained hyper-connections (DeepSeek-V4 report 2.2, eqs. 1-8;
    model/layers/hyper_connections.py): `hc_mult` residual streams (1 = plain residuals, no
    mHC at all), Sinkhorn-Knopp `sinkhorn_iters` iterations with floor `eps`."""

    section = "hyper_connections"

    hc_mult: int = 1
    sinkhorn_iters: int = 20
    eps: float = 1e-6

    def validate(self) -> None:
        check_int("hc_mult", self.hc_mult, 1)
        check_int("sinkhorn_iters", self.sinkhorn_iters, 1)
        check_positive("eps", self.eps)


@dataclasses.dataclass(frozen=True)
class MoEConfig(Config):
    """Routed + shared experts (report 2.2, Table 6) and the router (docs/architecture.md)."""

    section = "moe"

    num_experts: int = 288
    top_k: int = 8
    expert_hidden: int = 1280
    num_shared_experts: int = 1
    shared_hidden: int = 1280
    router_activation: str = "sigmoid"
    router_bias: bool = True  # loss-free balancing bias used for selection only
    renormalize: bool = True
    routed_scaling_factor: float = 3.0
    num_ep_groups: int = 8  # G of the EP-group balance loss (eq. 1)
    # DeepSeek-V3's group-limited routing (as MiMo-V2-Flash's release configures it): experts
    # form `num_groups` contiguous groups, a group scores the sum of its two best biased scores,
    # and the top-k is taken within the best `topk_groups` groups. 1 / 1: no limit.
    num_groups: int = 1
    topk_groups: int = 1
    # The first `hash_layers` MoE layers choose experts by token id (DeepSeek-V4 report 2.1;
    # model/layers/hash_routing.py) and have no loss-free bias.
    hash_layers: int = 0
    # `sorted`: largest row chunk of an expert's matmuls (256: 1.4x a dense FFN of equal FLOPs on
    # CPU, 128: 1.55x; docs/performance.md); `pallas`: the grouped matmuls' row tile.
    block_size: int = 256
    # Most tokens per device per expert-parallel exchange (model/parallel/expert_parallel.py):
    # bounds the dropless receive buffers to ep x this x top_k rows; 0 = all of a layer's at once.
    ep_chunk_tokens: int = 0

    def validate(self) -> None:
        check_int("num_experts", self.num_experts, 1)
        check_int("top_k", self.top_k, 1)
        if self.top_k > self.num_experts:
            raise ConfigError("top_k", f"{self.top_k} exceeds num_experts={self.num_experts}")
        check_int("expert_hidden", self.expert_hidden, 1)
        check_int("num_shared_experts", self.num_shared_experts, 0)
        if self.num_shared_experts:
            check_int("shared_hidden", self.shared_hidden, 1)
        check_choice("router_activation", self.router_activation, ROUTER_ACTIVATIONS)
        check_bool("router_bias", self.router_bias)
        check_bool("renormalize", self.renormalize)
        check_positive("routed_scaling_factor", self.routed_scaling_factor)
        check_int("num_ep_groups", self.num_ep_groups, 1)
        if self.num_experts % self.num_ep_groups:
            raise ConfigError("num_ep_groups", f"{self.num_ep_groups} does not divide "
                              f"num_experts={self.num_experts}")
        check_int("block_size", self.block_size, 1)
        check_int("ep_chunk_tokens", self.ep_chunk_tokens, 0)
        check_int("hash_layers", self.hash_layers, 0)
        check_int("num_groups", self.num_groups, 1)
        check_int("topk_groups", self.topk_groups, 1)
        if self.num_experts % self.num_groups:
            raise ConfigError("num_groups", f"{self.num_groups} does not divide "
                              f"num_experts={self.num_experts}")
        if self.topk_groups > self.num_groups:
            raise ConfigError("topk_groups", f"{self.topk_groups} exceeds num_groups="
                              f"{self.num_groups}")
        if self.num_groups > 1 and self.top_k > self.topk_groups * self.num_experts // self.num_groups:
            raise ConfigError("top_k", f"{self.top_k} exceeds the {self.topk_groups} groups of "
                              f"{self.num_experts // self.num_groups} experts it may choose from")


@dataclasses.dataclass(frozen=True)
class ModelConfig(Config):
    """Everything that defines the network. Defaults are Step 3.5 Flash (report Table 6)."""

    vocab_size: int = 128_896
    d_model: int = 4096
    num_layers: int = 45
    layout: str = "F+SSSF*11"  # one char per layer after expansion; layer i%4==0 is full
    window: int = 512
    head_dim: int = 128  # of queries and keys
    num_kv_heads: int = 8
    v_head_dim: int | None = None  # None: head_dim (MiMo-V2-Flash: 128 against 192)
    full_attention: AttentionTypeConfig = AttentionTypeConfig(
        num_heads=64, rope_theta=5_000_000.0, partial_rotary_factor=0.5
    )
    swa_attention: AttentionTypeConfig = AttentionTypeConfig(
        num_heads=96, rope_theta=10_000.0, partial_rotary_factor=1.0
    )
    # DeepSeek-V4's attention, used by the W / C / H layers of `layout`.
    shared_kv_attention: SharedKVAttentionConfig = SharedKVAttentionConfig()
    hyper_connections: HyperConnectionConfig = HyperConnectionConfig()
    gate: str = "headwise"
    qk_norm: bool = True
    # Values are multiplied by this before attention (MiMo-V2-Flash's release: 0.707).
    value_scale: float = 1.0
    num_dense_layers: int = 3
    moe_layers: tuple[int, ...] | None = None  # explicit MoE layer indices override the above
    dense_hidden: int = 11_264
    moe: MoEConfig = MoEConfig()
    # Per-layer SwiGLU clamps (report 4.1.3); 0 = no clamp. `swiglu_limits` for routed experts,
    # `swiglu_limits_shared` for the shared expert and dense FFNs (checkpoint convention).
    swiglu_limits: tuple[float, ...] = ()
    swiglu_limits_shared: tuple[float, ...] = ()
    # Where the clamp caps the gate: after the SiLU (Step 3.5) or before it (DeepSeek-V4).
    swiglu_gate_clamp: str = "after_silu"
    mtp: MTPConfig = MTPConfig()
    qat: QATConfig = QATConfig()
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    attention_impl: str = "xla"
    moe_impl: str = "sorted"
    remat_policy: str = "none"
    scan_layers: bool = True
    init_std: float = 0.02
    # Parallel execution under a device mesh (model/parallel/expert_parallel.py, pipeline.py,
    # context.py): the collective that moves tokens to their experts' devices (`ragged`:
    # ragged_all_to_all, GPU/TPU; `padded`: all_to_all of worst-case-sized chunks, any backend;
    # `auto`: padded on CPU, whose XLA lacks ragged_all_to_all), the micro-batches per pipelined
    # forward (0 = twice the stages), the virtual stages per device (1: GPipe; V > 1:
    # interleaved), whether a pipeline tick saves only its stage input (recomputing the stage in
    # the backward pass), and how a sequence split over `mesh.context` lays out its chunks
    # (`auto`: `balanced`, the causal load balance, with full-attention layers, else contiguous).
    ep_collective: str = "auto"
    pipeline_microbatches: int = 0
    pipeline_virtual_stages: int = 1
    pipeline_stage_remat: bool = True
    context_layout: str = "auto"

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, 1)  # the per-layer lists below depend on it
        if self.num_layers > MAX_LAYERS:
            raise ConfigError("num_layers", f"must be at most {MAX_LAYERS}, got {self.num_layers}")
        object.__setattr__(self, "layout", expand_layout(self.layout))
        for name in ("swiglu_limits", "swiglu_limits_shared"):
            object.__setattr__(self, name, self._per_layer_limits(name, getattr(self, name)))
        if self.moe_layers is not None:
            if not isinstance(self.moe_layers, (list, tuple)):
                raise ConfigError("moe_layers", f"must be a list of layer indices, "
                                                f"got {self.moe_layers!r}")
            object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        super().__post_init__()

    def _per_layer_limits(self, name: str, value: Any) -> tuple[float, ...]:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = (float(value),) * self.num_layers
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise ConfigError(name, f"must be a number or a list of numbers, got {value!r}")
        limits = tuple(float(v) for v in value)
        if not limits:
            return (0.0,) * self.num_layers
        if len(limits) != self.num_layers:
            raise ConfigError(name, f"has {len(limits)} entries, expected one per layer "
                              f"(num_layers={self.num_layers}) or a single number")
        if any(v < 0 for v in limits):
            raise ConfigError(name, f"limits must be >= 0 (0 disables the clamp), got {limits}")
        return limits

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "num_layers", "window", "head_dim", "num_kv_heads",
                     "dense_hidden"):
            check_int(name, getattr(self, name), 1)
        for name in ("vocab_size", "window"):  # token ids and positions are int32
            if getattr(self, name) > INT32_MAX:
                raise ConfigError(name, f"must be at most {INT32_MAX} (token ids and positions "
                                  f"are int32), got {getattr(self, name)}")
        if len(self.layout) != self.num_layers:
            raise ConfigError("layout", f"expands to {len(self.layout)} layers ({self.layout!r}) "
                              f"but num_layers={self.num_layers}")
        check_choice("gate", self.gate, GATE_TYPES)
        for name in ("full_attention", "swa_attention"):
            try:
                resolve_geometry(getattr(self, name), self.num_kv_heads, self.head_dim,
                                 self.v_head_dim, self.gate)
            except ConfigError as err:
                raise err.within(name) from None
        check_positive("value_scale", self.value_scale)
        if self.v_head_dim is not None:
            check_int("v_head_dim", self.v_head_dim, 1)
        if self.swa_attention.rope_scaling.type != "none":
            raise ConfigError("swa_attention.rope_scaling", "context-extension scaling applies "
                              "to full-attention layers only (docs/architecture.md); set it under "
                              "full_attention")
        check_choice("swiglu_gate_clamp", self.swiglu_gate_clamp, GATE_CLAMPS)
        check_int("num_dense_layers", self.num_dense_layers, 0)
        if self.num_dense_layers > self.num_layers:
            raise ConfigError("num_dense_layers",
                              f"{self.num_dense_layers} exceeds num_layers={self.num_layers}")
        if self.moe_layers is not None:
            bad = [i for i in self.moe_layers if not (isinstance(i, int) and 0 <= i < self.num_layers)]
            if bad or len(set(self.moe_layers)) != len(self.moe_layers):
                raise ConfigError("moe_layers", f"entries must be distinct layer indices in "
                                  f"[0, {self.num_layers}), got {list(self.moe_layers)}")
        if self.moe.hash_layers > self.num_moe_layers:
            raise ConfigError("moe.hash_layers", f"{self.moe.hash_layers} exceeds the "
                              f"{self.num_moe_layers} MoE layers")
        self.qat.check_model(
            experts=bool(self.num_moe_layers or (self.mtp.num_heads and self.mtp.block == "layer")),
            indexer="C" in self.layout, index_head_dim=self.shared_kv_attention.index_head_dim)
        check_positive("norm_eps", self.norm_eps)
        check_positive("init_std", self.init_std)
        check_choice("param_dtype", self.param_dtype, DTYPES)
        check_choice("compute_dtype", self.compute_dtype, DTYPES)
        ATTENTION.check(self.attention_impl)
        MOE.check(self.moe_impl)
        check_choice("remat_policy", self.remat_policy, REMAT_POLICIES)
        check_choice("ep_collective", self.ep_collective, EP_COLLECTIVES)
        check_int("pipeline_microbatches", self.pipeline_microbatches, 0)
        check_int("pipeline_virtual_stages", self.pipeline_virtual_stages, 1)
        check_choice("context_layout", self.context_layout, CONTEXT_LAYOUTS)
        for name in ("qk_norm", "tie_embeddings", "scan_layers", "pipeline_stage_remat"):
            check_bool(name, getattr(self, name))

    # ---- derived per-layer facts -------------------------------------------------------------

    def attention_type(self, layer: int) -> str:
        return self.layout[layer]

    def uses_shared_kv(self) -> bool:
        """A layer (or an MTP block) with DeepSeek-V4's shared-KV attention (W, C or H)."""
        kinds = set(self.layout) | ({self.mtp.attention_type} if self.mtp.num_heads else set())
        return bool(kinds & set(SHARED_KV_KINDS))

    def attention_config(self, attention_type: str) -> AttentionTypeConfig:
        """The GQA settings of layer character F or S (W / C / H: `shared_kv_attention`)."""
        return self.full_attention if attention_type == "F" else self.swa_attention

    def attention_geometry(self, attention_type: str) -> AttentionGeometry:
        """Heads, head dims, RoPE and gate of GQA layer character F or S, per-type settings
        resolved against the model's `num_kv_heads`, `head_dim` and `gate`."""
        return resolve_geometry(self.attention_config(attention_type), self.num_kv_heads,
                                self.head_dim, self.v_head_dim, self.gate)

    def is_hash_layer(self, layer: int) -> bool:
        """An MoE layer among the first `moe.hash_layers` ones: routed by token id."""
        if not self.moe.hash_layers or not self.is_moe_layer(layer):
            return False  # (the common case answered without listing the MoE layers)
        return sum(map(self.is_moe_layer, range(layer))) < self.moe.hash_layers

    def is_moe_layer(self, layer: int) -> bool:
        if self.moe_layers is not None:
            return layer in self.moe_layers
        return layer >= self.num_dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def moe_layer_indices(self) -> list[int]:
        """Model layer index of each MoE layer, in order (the order of `out.aux['moe']`)."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
