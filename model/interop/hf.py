"""Hugging Face Step 3.5 Flash checkpoints (`model_type: step3p5`) <-> stepjax variables.

    cfg, variables = load_hf_checkpoint("Step-3.5-Flash/")     # streams shard by shard
    save_hf_checkpoint(cfg, variables, "exported/", dtype="bfloat16")
    python -m model.hf import HF_DIR --out MODEL_DIR           # -> a model/weights.py directory
    python -m model.hf export MODEL_DIR_OR_WORKDIR --out HF_DIR [--dtype bfloat16]

The format (DESIGN.md §3), as the public loaders read it: vLLM
`vllm/model_executor/models/step3p5.py` and `step3p5_mtp.py`, mlx-lm `mlx_lm/models/step3p5.py`,
llama.cpp's Step3p5 converter and the reference modeling code (mirrored in Ascend/MindSpeed-LLM
`mindspeed_llm/fsdp2/models/step35/modeling_step3p5.py`):
- torch Linear weights are [out, in]: q/k/v_proj [heads*head_dim, d] (head-major), o_proj
  [d, heads*head_dim], g_proj [heads, d]; the router `moe.gate.weight` [E, d] with
  `moe.router_bias` [E] (float32); routed experts stacked `moe.{gate,up}_proj.weight` [E, I, d]
  and `moe.down_proj.weight` [E, d, I]; the shared expert `share_expert.*` sits beside `moe`.
- Every norm weight is an offset applied as (1 + w), as in model/layers/norm.py.
- MTP head h is `model.layers.{num_hidden_layers + h}`: its block's tensors directly under that
  prefix (a dense `mlp`), `enorm`, `hnorm`, `eh_proj` [d, 2d] applied to
  [enorm(embedding); hnorm(hidden)] (model/layers/mtp.py's order) and its own
  `transformer.shared_head.{norm,output}`.
- config.json's per-layer lists (`layer_types`, `rope_theta`, `partial_rotary_factors`,
  `swiglu_limits`, `swiglu_limits_shared`) carry num_hidden_layers + num_nextn_predict_layers
  entries (MTP layers last); SWA head counts are in `attention_other_setting`, MoE layers in
  `moe_layers_enum` ("3,4,...,44"); `rope_scaling` applies to `yarn_only_types`.
Config keys that do not change the network (token ids, max_position_embeddings, torch_dtype,
...) are ignored on import.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from model import weights
from model.config.cli import ArgumentParser, report_error
from model.config import (
    DTYPES, AttentionTypeConfig, ModelConfig, MoEConfig, MTPConfig, RopeScaling,
)
from model.layers.layer_plan import layer_kinds, plan_segments

MODEL_TYPE = "step3p5"
INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_LAYER_TYPES = {"full_attention": "F", "sliding_attention": "S"}
_HF_LAYER_TYPES = {code: name for name, code in _LAYER_TYPES.items()}
_FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
# config.json entries whose other values change the network in ways stepjax does not implement
# (first allowed value = the default when the key is absent).
_REQUIRED_VALUES = {
    "att_impl_type": ("GQA",),
    "hidden_act": ("silu",),
    "zero_centered": (True,),  # norms applied as (1 + w)
    "sink": (False, None),  # attention-sink tensors, absent from the released model
    "quantization_config": (None,),  # the FP8 / Int4 releases
}


class CheckpointFormatError(ValueError):
    """A checkpoint file, tensor or config entry that does not fit the model (one line)."""


# ---- config.json <-> ModelConfig ---------------------------------------------------------------


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig of a Step 3.5 config.json: the architecture from the file, runtime fields
    (dtypes, kernels, scan, remat, ...) at their defaults. MoE layers come back as
    `num_dense_layers` when they are a suffix of the stack, else as `moe_layers`."""
    if hf.get("model_type") != MODEL_TYPE:
        raise CheckpointFormatError(
            f"model_type: expected {MODEL_TYPE!r}, got {hf.get('model_type')!r}")
    for key, allowed in _REQUIRED_VALUES.items():
        if hf.get(key, allowed[0]) not in allowed:
            raise CheckpointFormatError(f"{key}: {hf[key]!r} is not supported "
                                        f"(stepjax implements {allowed[0]!r})")
    if not all(hf.get("use_rope_layers") or [True]):
        raise CheckpointFormatError("use_rope_layers: layers without RoPE are not supported")
    num_layers = _required(hf, "num_hidden_layers")
    num_mtp = hf.get("num_nextn_predict_layers", 0)
    types = _layer_types(hf, num_layers, num_mtp)
    moe_layers = _moe_layers_from_hf(hf, num_layers)
    dense = num_layers - len(moe_layers)
    suffix = moe_layers == list(range(dense, num_layers))
    head_dim = hf.get("head_dim") or _required(hf, "hidden_size") // _required(
        hf, "num_attention_heads")
    fields = dict(
        vocab_size=_required(hf, "vocab_size"), d_model=_required(hf, "hidden_size"),
        num_layers=num_layers, layout=types[:num_layers],
        window=hf.get("sliding_window") or ModelConfig.window,
        num_kv_heads=_required(hf, "num_attention_groups"), head_dim=head_dim,
        **_attention_from_hf(hf, types, num_layers, head_dim),
        gate="headwise" if hf.get("use_head_wise_attn_gate", False) else "none",
        qk_norm=hf.get("use_qk_norm", True),
        num_dense_layers=dense if suffix else 0, moe_layers=None if suffix else tuple(moe_layers),
        dense_hidden=_required(hf, "intermediate_size"), moe=_moe_from_hf(hf),
        swiglu_limits=_limits_from_hf(hf, "swiglu_limits", num_layers, num_mtp),
        swiglu_limits_shared=_limits_from_hf(hf, "swiglu_limits_shared", num_layers, num_mtp),
        mtp=MTPConfig(num_heads=num_mtp), tie_embeddings=hf.get("tie_word_embeddings", False),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)))
    try:
        return ModelConfig(**fields)
    except ValueError as err:
        raise CheckpointFormatError(f"config.json gives an invalid stepjax config: {err}") from None


def _attention_from_hf(hf: Mapping, types: str, num_layers: int, head_dim: int) -> dict:
    """`full_attention` / `swa_attention` of ModelConfig; absent RoPE settings take the
    reference's defaults (theta 1e4, RoPE on every dim)."""
    theta = _per_type(hf, "rope_theta", types, num_layers, 10_000.0)
    rotary = _per_type(hf, "partial_rotary_factors", types, num_layers, 1.0)
    heads = _required(hf, "num_attention_heads")
    other = hf.get("attention_other_setting") or {}
    for key, expected in (("num_attention_groups", hf.get("num_attention_groups")),
                          ("head_dim", head_dim),
                          ("attention_type", "sliding_attention")):
        if other.get(key, expected) != expected:
            raise CheckpointFormatError(
                f"attention_other_setting.{key}: {other[key]!r} differs from {expected!r}; "
                "stepjax shares it between attention types")
    return dict(
        full_attention=AttentionTypeConfig(
            num_heads=heads, rope_theta=theta["F"], partial_rotary_factor=rotary["F"],
            rope_scaling=_rope_scaling_from_hf(hf, types)),
        swa_attention=AttentionTypeConfig(
            num_heads=other.get("num_attention_heads", heads), rope_theta=theta["S"],
            partial_rotary_factor=rotary["S"]))


def _moe_from_hf(hf: Mapping) -> MoEConfig:
    num_experts = hf.get("moe_num_experts", MoEConfig.num_experts)
    shared = hf.get("share_expert_dim", MoEConfig.shared_hidden)  # 0: no shared expert
    return MoEConfig(
        num_experts=num_experts, top_k=hf.get("moe_top_k", MoEConfig.top_k),
        expert_hidden=hf.get("moe_intermediate_size", MoEConfig.expert_hidden),
        num_shared_experts=1 if shared else 0, shared_hidden=shared or MoEConfig.shared_hidden,
        router_activation=hf.get("moe_router_activation", "sigmoid"),
        router_bias=hf.get("use_moe_router_bias", True),
        renormalize=hf.get("norm_expert_weight", True),
        routed_scaling_factor=float(hf.get("moe_router_scaling_factor", 1.0)),
        # G of the balance loss (eq. 1) is a training choice the checkpoint does not carry:
        # the default, or a divisor of the expert count.
        num_ep_groups=math.gcd(MoEConfig.num_ep_groups, num_experts))


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json of `cfg` (per-layer lists include the MTP layers, which are SWA blocks with
    a dense, unclamped FFN: model/layers/mtp.py)."""
    if cfg.gate == "sink":
        raise CheckpointFormatError("gate: 'sink' has no Step 3.5 checkpoint equivalent; "
                                    "export models with gate 'headwise' or 'none'")
    types = cfg.layout + "S" * cfg.mtp.num_heads
    per_layer = lambda field: [getattr(cfg.attention_config(t), field) for t in types]  # noqa: E731
    no_clamp = [0.0] * cfg.mtp.num_heads
    kv, head_dim = cfg.num_kv_heads, cfg.head_dim
    return {
        "model_type": MODEL_TYPE, "architectures": ["Step3p5ForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers, "head_dim": head_dim,
        "num_attention_heads": cfg.full_attention.num_heads, "num_attention_groups": kv,
        "attention_other_setting": {"attention_type": "sliding_attention",
                                    "num_attention_heads": cfg.swa_attention.num_heads,
                                    "num_attention_groups": kv, "head_dim": head_dim},
        "att_impl_type": "GQA", "sliding_window": cfg.window,
        "layer_types": [_HF_LAYER_TYPES[t] for t in types],
        "rope_theta": per_layer("rope_theta"),
        "partial_rotary_factors": per_layer("partial_rotary_factor"),
        "rope_scaling": _rope_scaling_to_hf(cfg.full_attention.rope_scaling),
        "yarn_only_types": ["full_attention"],
        "use_head_wise_attn_gate": cfg.gate == "headwise", "use_qk_norm": cfg.qk_norm,
        "zero_centered": True, "hidden_act": "silu", "intermediate_size": cfg.dense_hidden,
        "moe_layers_enum": ",".join(str(i) for i in cfg.moe_layer_indices()),
        "moe_num_experts": cfg.moe.num_experts, "moe_top_k": cfg.moe.top_k,
        "moe_intermediate_size": cfg.moe.expert_hidden,
        "share_expert_dim": cfg.moe.shared_hidden * cfg.moe.num_shared_experts,
        "moe_router_activation": cfg.moe.router_activation,
        "moe_router_scaling_factor": cfg.moe.routed_scaling_factor,
        "use_moe_router_bias": cfg.moe.router_bias, "norm_expert_weight": cfg.moe.renormalize,
        "need_fp32_gate": True,  # model/layers/moe.py computes router logits in float32
        "swiglu_limits": [*cfg.swiglu_limits, *no_clamp],
        "swiglu_limits_shared": [*cfg.swiglu_limits_shared, *no_clamp],
        "num_nextn_predict_layers": cfg.mtp.num_heads,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
    }


def _required(values: Mapping[str, Any], key: str, prefix: str = "") -> Any:
    if values.get(key) is None:
        raise CheckpointFormatError(f"{prefix}{key}: missing from config.json")
    return values[key]


def _check_length(field: str, values: Sequence, num_layers: int, num_mtp: int) -> None:
    if len(values) not in (num_layers, num_layers + num_mtp):
        raise CheckpointFormatError(
            f"{field}: has {len(values)} entries, expected num_hidden_layers={num_layers} "
            f"(+ num_nextn_predict_layers={num_mtp})")


def _layer_types(hf: Mapping, num_layers: int, num_mtp: int) -> str:
    """'F'/'S' per layer, MTP layers included (they must be sliding-window blocks)."""
    names = _required(hf, "layer_types")
    _check_length("layer_types", names, num_layers, num_mtp)
    unknown = sorted({n for n in names if n not in _LAYER_TYPES})
    if unknown:
        raise CheckpointFormatError(
            f"layer_types: unknown {unknown}, expected {list(_LAYER_TYPES)}")
    if any(n != "sliding_attention" for n in names[num_layers:]):
        raise CheckpointFormatError("layer_types: stepjax MTP blocks are sliding-window "
                                    f"layers, got {names[num_layers:]} for the MTP layers")
    return "".join(_LAYER_TYPES[n] for n in names[:num_layers]) + "S" * num_mtp


def _per_type(hf: Mapping, field: str, types: str, num_layers: int, default: float) -> dict:
    """{'F': value, 'S': value} of a per-layer list (or one number) that stepjax keeps once
    per attention type; `default` when absent and for a type without layers."""
    values = hf.get(field)
    if values is None or isinstance(values, (int, float)):
        value = float(default if values is None else values)
        return {"F": value, "S": value}
    _check_length(field, values, num_layers, len(types) - num_layers)
    seen: dict[str, set] = {"F": set(), "S": set()}
    for kind, value in zip(types, values):
        seen[kind].add(float(value))
    for kind, found in seen.items():
        if len(found) > 1:
            raise CheckpointFormatError(
                f"{field}: stepjax has one value per attention type, but the "
                f"{_HF_LAYER_TYPES[kind]} layers use {sorted(found)}")
    return {kind: found.pop() if found else float(default) for kind, found in seen.items()}


def _rope_scaling_from_hf(hf: Mapping, types: str) -> RopeScaling:
    raw = hf.get("rope_scaling") or {}
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind == "default":
        return RopeScaling()
    extra = {"yarn": ("beta_fast", "beta_slow"), "llama3": ("low_freq_factor", "high_freq_factor")}
    if kind not in extra:
        raise CheckpointFormatError(f"rope_scaling.rope_type: {kind!r} is not supported, "
                                    f"expected one of {['default', *extra]}")
    for key in raw:
        if key not in {"rope_type", "type", "factor", "original_max_position_embeddings",
                       *extra[kind]}:
            raise CheckpointFormatError(f"rope_scaling.{key}: not supported with {kind} scaling")
    # The reference applies the scaling to every layer unless `yarn_only_types` restricts it;
    # stepjax scales full-attention layers only (DESIGN.md §3).
    scaled = hf.get("yarn_only_types") or list(_LAYER_TYPES)
    if "sliding_attention" in scaled and "S" in types:
        raise CheckpointFormatError(f"yarn_only_types: {scaled} scales sliding-window layers; "
                                    "stepjax supports ['full_attention'] only")
    if "full_attention" not in scaled:
        return RopeScaling()
    return RopeScaling(
        type=kind, factor=float(_required(raw, "factor", "rope_scaling.")),
        original_max_len=int(_required(raw, "original_max_position_embeddings", "rope_scaling.")),
        **{key: float(raw[key]) for key in extra[kind] if key in raw})


def _rope_scaling_to_hf(scaling: RopeScaling) -> dict | None:
    if scaling.type == "none":
        return None
    extra = (("beta_fast", "beta_slow") if scaling.type == "yarn"
             else ("low_freq_factor", "high_freq_factor"))
    return {"rope_type": scaling.type, "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_len,
            **{key: getattr(scaling, key) for key in extra}}


def _moe_layers_from_hf(hf: Mapping, num_layers: int) -> list[int]:
    """Sorted MoE layer indices; without `moe_layers_enum` every layer but the first (the
    reference modeling code's default)."""
    raw = hf.get("moe_layers_enum")
    if raw is None:
        return list(range(1, num_layers))
    try:
        indices = ([int(x) for x in raw.split(",") if x.strip()] if isinstance(raw, str)
                   else [int(x) for x in raw])
    except (TypeError, ValueError):
        raise CheckpointFormatError(f"moe_layers_enum: expected comma-separated layer indices, "
                                    f"got {raw!r}") from None
    if any(not 0 <= i < num_layers for i in indices) or len(set(indices)) != len(indices):
        raise CheckpointFormatError(f"moe_layers_enum: entries must be distinct indices in "
                                    f"[0, {num_layers}), got {raw!r}")
    return sorted(indices)


def _limits_from_hf(hf: Mapping, field: str, num_layers: int, num_mtp: int) -> tuple:
    """Per-layer SwiGLU clamps of the decoder layers (None = 0 = no clamp)."""
    values = hf.get(field)
    if values is None:
        return ()
    if not isinstance(values, list):
        raise CheckpointFormatError(f"{field}: expected a list with one limit per layer")
    _check_length(field, values, num_layers, num_mtp)
    limits = [float(v or 0.0) for v in values]
    if any(limits[num_layers:]):
        raise CheckpointFormatError(f"{field}: stepjax MTP blocks are unclamped, got "
                                    f"{limits[num_layers:]} for the MTP layers")
    return tuple(limits[:num_layers])


# ---- the tensor-name table ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Same:
    """Stored as-is: norm weights, embeddings, the router bias."""

    def hf_shape(self, shape: tuple) -> tuple:
        return tuple(shape)

    def to_ours(self, array: np.ndarray, shape: tuple) -> np.ndarray:
        return array

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        return array


@dataclasses.dataclass(frozen=True)
class Linear:
    """torch Linear weight [out, in] <-> our kernel [*in, *out] contracting its first `inputs`
    dims: q_proj [H*D, d] <-> [d, H, D]; o_proj (inputs=2) [d, H*D] <-> [H, D, d]."""

    inputs: int = 1

    def hf_shape(self, shape: tuple) -> tuple:
        return (math.prod(shape[self.inputs:]), math.prod(shape[:self.inputs]))

    def to_ours(self, array: np.ndarray, shape: tuple) -> np.ndarray:
        return array.T.reshape(shape)

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        return array.reshape(math.prod(array.shape[:self.inputs]), -1).T


@dataclasses.dataclass(frozen=True)
class Experts:
    """Stacked expert weights [E, out, in] <-> our [E, in, out]."""

    def hf_shape(self, shape: tuple) -> tuple:
        return (shape[0], shape[2], shape[1])

    def to_ours(self, array: np.ndarray, shape: tuple) -> np.ndarray:
        return array.transpose(0, 2, 1)

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        return array.transpose(0, 2, 1)


class Rule(NamedTuple):
    hf: str  # tensor name, relative to its layer prefix
    ours: str  # variable path inside `collection`, relative to the layer's subtree
    transform: Any
    collection: str = "params"


SAME, LINEAR = Same(), Linear()
TOP_RULES = (
    Rule("model.embed_tokens.weight", "embed_tokens/embedding", SAME),
    Rule("model.norm.weight", "norm/weight", SAME),
    Rule("lm_head.weight", "lm_head/kernel", LINEAR),
)
# One decoder block (model/layers/block.py); also each MTP head's block.
BLOCK_RULES = (
    Rule("input_layernorm.weight", "input_layernorm/weight", SAME),
    Rule("self_attn.q_proj.weight", "self_attn/q_proj/kernel", LINEAR),
    Rule("self_attn.k_proj.weight", "self_attn/k_proj/kernel", LINEAR),
    Rule("self_attn.v_proj.weight", "self_attn/v_proj/kernel", LINEAR),
    Rule("self_attn.o_proj.weight", "self_attn/o_proj/kernel", Linear(inputs=2)),
    Rule("self_attn.g_proj.weight", "self_attn/g_proj/kernel", LINEAR),
    Rule("self_attn.q_norm.weight", "self_attn/q_norm/weight", SAME),
    Rule("self_attn.k_norm.weight", "self_attn/k_norm/weight", SAME),
    Rule("post_attention_layernorm.weight", "post_attention_layernorm/weight", SAME),
    Rule("mlp.gate_proj.weight", "mlp/gate_proj/kernel", LINEAR),
    Rule("mlp.up_proj.weight", "mlp/up_proj/kernel", LINEAR),
    Rule("mlp.down_proj.weight", "mlp/down_proj/kernel", LINEAR),
    Rule("moe.gate.weight", "moe/router", LINEAR),
    Rule("moe.router_bias", "moe/router_bias", SAME, collection="balance"),
    Rule("moe.gate_proj.weight", "moe/gate_proj", Experts()),
    Rule("moe.up_proj.weight", "moe/up_proj", Experts()),
    Rule("moe.down_proj.weight", "moe/down_proj", Experts()),
    Rule("share_expert.gate_proj.weight", "moe/shared_expert/gate_proj/kernel", LINEAR),
    Rule("share_expert.up_proj.weight", "moe/shared_expert/up_proj/kernel", LINEAR),
    Rule("share_expert.down_proj.weight", "moe/shared_expert/down_proj/kernel", LINEAR),
)
MTP_RULES = (
    Rule("enorm.weight", "enorm/weight", SAME),
    Rule("hnorm.weight", "hnorm/weight", SAME),
    Rule("eh_proj.weight", "eh_proj/kernel", LINEAR),
    Rule("transformer.shared_head.norm.weight", "norm/weight", SAME),
    Rule("transformer.shared_head.output.weight", "output_head/kernel", LINEAR),
)


class Entry(NamedTuple):
    """One checkpoint tensor and the variable (slice) it is."""

    name: str
    collection: str
    path: tuple[str, ...]  # inside the collection
    index: int | None  # slot along the stacked `layers` axis of a scanned variable
    shape: tuple[int, ...]  # our shape of the slot
    transform: Any

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return self.transform.hf_shape(self.shape)


def layer_slots(cfg: ModelConfig) -> list[tuple[tuple[str, ...], int | None]]:
    """Where decoder layer i lives: (subtree path, index along the stacked axis or None).
    Scanned layout as in model/layers/stack.py: layer start + r * period + j is slot r of
    `layers/segment_s/block_j`."""
    if not cfg.scan_layers:
        return [(("layers", f"layer_{i}"), None) for i in range(cfg.num_layers)]
    slots: list = [None] * cfg.num_layers
    for s, seg in enumerate(plan_segments(layer_kinds(cfg))):
        for r in range(seg.repeats):
            for j in range(seg.period):
                slots[seg.start + r * seg.period + j] = (
                    ("layers", f"segment_{s}", f"block_{j}"), r)
    return slots


def _lookup(tree: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def tensor_table(cfg: ModelConfig, abstract: dict) -> list[Entry]:
    """Every checkpoint tensor of `cfg` with its variable, in checkpoint order. `abstract`:
    unboxed variables (or their ShapeDtypeStructs); rules whose variable the model lacks
    (g_proj without a head-wise gate, lm_head with tied embeddings, ...) drop out."""
    entries = []

    def add(name: str, rule: Rule, prefix: tuple = (), index: int | None = None) -> None:
        path = (*prefix, *rule.ours.split("/"))
        leaf = _lookup(abstract.get(rule.collection, {}), path)
        if leaf is not None:
            shape = tuple(leaf.shape[1:] if index is not None else leaf.shape)
            entries.append(Entry(name, rule.collection, path, index, shape, rule.transform))

    embed, norm, lm_head = TOP_RULES
    add(embed.hf, embed)
    for i, (prefix, index) in enumerate(layer_slots(cfg)):
        for rule in BLOCK_RULES:
            add(f"model.layers.{i}.{rule.hf}", rule, prefix, index)
    main_head = lm_head if "lm_head" in abstract["params"] else embed  # tied embeddings
    for h in range(cfg.mtp.num_heads):
        layer = f"model.layers.{cfg.num_layers + h}"
        for rule in BLOCK_RULES:
            add(f"{layer}.{rule.hf}", rule, (f"mtp_{h}", "block"))
        for rule in MTP_RULES:
            add(f"{layer}.{rule.hf}", rule, (f"mtp_{h}",))
        if cfg.mtp.share_output_head:  # the format stores one output head per MTP layer
            add(f"{layer}.{MTP_RULES[-1].hf}", main_head)
    add(norm.hf, norm)
    add(lm_head.hf, lm_head)
    _check_coverage(abstract, entries)
    return entries


def _check_coverage(abstract: dict, entries: list[Entry]) -> None:
    """Every variable (every layer slot of a stacked one) must have a checkpoint name, or an
    import would leave it unset."""
    covered: dict[tuple, set] = {}
    for e in entries:
        covered.setdefault((e.collection, e.path), set()).add(e.index)
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        keys = tuple(str(k.key) for k in path)
        slots = covered.get((keys[0], keys[1:]), set())
        if slots != {None} and slots != set(range(leaf.shape[0] if leaf.shape else 0)):
            raise CheckpointFormatError(f"{'/'.join(keys)}: no Step 3.5 checkpoint tensor maps "
                                        "to this variable")


# ---- import -------------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointFormatError(f"{path} not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointFormatError(f"{path}: not valid JSON ({err})") from None


def _shard_names(path: Path) -> dict[str, list[str]]:
    """{shard file: tensor names} from the index, or the single `model.safetensors`."""
    if (path / INDEX).is_file():
        weight_map = _read_json(path / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointFormatError(f"{path / INDEX}: no 'weight_map'")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        return files
    if (path / SINGLE_FILE).is_file():
        with safe_open(path / SINGLE_FILE, framework="numpy") as f:
            return {SINGLE_FILE: list(f.keys())}
    raise CheckpointFormatError(f"{path}: neither {INDEX} nor {SINGLE_FILE} found")


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:4])
    return f"{shown}, ... ({len(names)} in total)" if len(names) > 4 else shown


def _check_tensors(path: Path, files: dict[str, list[str]], entries: dict[str, Entry]) -> None:
    """Names, dtypes and shapes of every tensor, from the shard headers only (no data read),
    so a mismatch is reported before anything is loaded."""
    stored = [name for names in files.values() for name in names]
    unknown = [name for name in stored if name not in entries]
    if unknown:
        raise CheckpointFormatError(f"{path}: unknown tensor (no stepjax variable): "
                                    f"{_listing(unknown)}")
    missing = sorted(set(entries) - set(stored))
    if missing:
        raise CheckpointFormatError(f"{path}: missing tensor: {_listing(missing)}")
    for file, names in files.items():
        if not (path / file).is_file():
            raise CheckpointFormatError(f"{path / file}: shard listed in {INDEX} not found")
        with safe_open(path / file, framework="numpy") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointFormatError(f"{name}: listed under {file} in {INDEX} but "
                                                "not stored there")
                tensor = f.get_slice(name)
                if tensor.get_dtype() not in _FLOAT_DTYPES:
                    raise CheckpointFormatError(
                        f"{name}: dtype {tensor.get_dtype()} is not supported (expected "
                        f"{'/'.join(_FLOAT_DTYPES)}; quantized checkpoints are not)")
                found, expected = list(tensor.get_shape()), list(entries[name].hf_shape)
                if found != expected:
                    raise CheckpointFormatError(f"{name}: expected {expected}, found {found}")


def load_hf_checkpoint(path: str | Path, mesh: jax.sharding.Mesh | None = None, *,
                       param_dtype: str | None = None,
                       progress: bool = True) -> tuple[ModelConfig, dict]:
    """(ModelConfig, variables) of a Hugging Face Step 3.5 directory.

    variables = {"params": ..., "balance": ...} as `nn.meta.unbox(CausalLM(cfg).init(...))`,
    in `param_dtype` (default the config's float32; the router bias stays float32), on one
    device or in the training shardings of `mesh`. Shards are read one at a time through
    safetensors' lazy (memory-mapped) reader and every tensor goes to its devices as it is
    read: a layer of a scanned (stacked) variable is written into its slot of a buffer that
    already lives in the variable's sharding, so host memory never holds more than one tensor
    beyond the open shard.
    """
    path = Path(path)
    config = config_from_hf(_read_json(path / "config.json"))
    if param_dtype is not None:
        config = config.replace(param_dtype=param_dtype)
    abstract = nn.meta.unbox(weights.abstract_variables(config))
    entries = {e.name: e for e in tensor_table(config, abstract)}
    files = _shard_names(path)
    _check_tensors(path, files, entries)
    shardings = weights.variable_shardings(config, mesh)
    variables: dict = {}
    for file, names in tqdm(files.items(), desc="import", unit="shard", disable=not progress,
                            file=sys.stderr):
        with safe_open(path / file, framework="numpy") as f:
            for name in names:
                entry = entries[name]
                leaf = _lookup(abstract[entry.collection], entry.path)
                sharding = _lookup(shardings[entry.collection], entry.path)
                value = entry.transform.to_ours(f.get_tensor(name), entry.shape).astype(leaf.dtype)
                if entry.index is None:
                    _insert(variables, entry, _place(value, sharding))
                    continue
                stacked = _lookup(variables.get(entry.collection, {}), entry.path)
                if stacked is None:
                    stacked = jnp.zeros(leaf.shape, leaf.dtype, device=sharding)
                _insert(variables, entry, _write_slot(stacked, _place(value, _slot(sharding)),
                                                      entry.index))
    return config, variables


def _place(array: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _slot(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """Sharding of one layer of a stacked variable: the stacked spec without its first axis."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
            *sharding.spec[1:]))
    return sharding


@functools.partial(jax.jit, donate_argnums=0)
def _write_slot(stacked: jax.Array, value: jax.Array, index) -> jax.Array:
    """stacked [L, ...] with layer `index` replaced by value [...], in place (donated)."""
    return jax.lax.dynamic_update_index_in_dim(stacked, value, index, 0)


def _insert(tree: dict, entry: Entry, value: Any) -> None:
    node = tree.setdefault(entry.collection, {})
    for part in entry.path[:-1]:
        node = node.setdefault(part, {})
    node[entry.path[-1]] = value


# ---- export -------------------------------------------------------------------------------------


def _check_variables(variables: dict, abstract: dict) -> None:
    """`variables` must have the config's structure and shapes (error names the first misfit)."""
    got = {jax.tree_util.keystr(p): a.shape
           for p, a in jax.tree_util.tree_flatten_with_path(variables)[0]}
    want = {jax.tree_util.keystr(p): a.shape
            for p, a in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    for key in sorted(set(got) | set(want)):
        if got.get(key) != want.get(key):
            raise CheckpointFormatError(f"variables{key}: shape {got.get(key)} but the config "
                                        f"expects {want.get(key)} (None = absent)")


def _shard_plan(sizes: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Consecutive tensor indices grouped into shards of at most `max_bytes` (a larger tensor
    gets a shard of its own)."""
    shards, current, used = [], [], 0
    for i, size in enumerate(sizes):
        if current and used + size > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    return shards + [current] if current else shards


def save_hf_checkpoint(config: ModelConfig, variables: dict, path: str | Path, *,
                       max_shard_bytes: int = 5 * 2**30, dtype: str | None = None,
                       progress: bool = True) -> None:
    """Writes `path/config.json` and the safetensors shards (`model.safetensors`, or
    `model-0000k-of-0000N.safetensors` + `model.safetensors.index.json`), materialising one
    shard on the host at a time. `dtype`: tensor dtype in the files (default: each variable's);
    the router bias is always float32, as the reference keeps it. `path` must be new or empty.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype: got {dtype!r}, allowed values are {list(DTYPES)}")
    hf_config = config_to_hf(config)
    abstract = nn.meta.unbox(weights.abstract_variables(config))
    _check_variables(variables, abstract)
    entries = tensor_table(config, abstract)

    def file_dtype(entry: Entry) -> np.dtype:
        leaf = _lookup(abstract[entry.collection], entry.path)
        return np.dtype(leaf.dtype if dtype is None or entry.collection == "balance" else dtype)

    sizes = [math.prod(e.shape) * file_dtype(e).itemsize for e in entries]
    plan = _shard_plan(sizes, max_shard_bytes)
    names = ([SINGLE_FILE] if len(plan) == 1 else
             [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))])
    with weights.fresh_directory(Path(path)) as staging:
        for file, shard in tqdm(list(zip(names, plan)), desc="export", unit="shard",
                                disable=not progress, file=sys.stderr):
            tensors = {}
            for entry in (entries[i] for i in shard):
                leaf = _lookup(variables[entry.collection], entry.path)
                value = np.asarray(leaf if entry.index is None else leaf[entry.index])
                tensors[entry.name] = np.ascontiguousarray(
                    entry.transform.to_hf(value).astype(file_dtype(entry)))
            save_file(tensors, staging / file, metadata={"format": "pt"})
        if len(plan) > 1:
            index = {"metadata": {"total_size": sum(sizes)},
                     "weight_map": {entries[i].name: file for file, shard in zip(names, plan)
                                    for i in shard}}
            (staging / INDEX).write_text(json.dumps(index, indent=1) + "\n")
        hf_config["torch_dtype"] = dtype or config.param_dtype
        (staging / "config.json").write_text(json.dumps(hf_config, indent=1) + "\n")


# ---- command line -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m model.hf", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{import,export}",
                                     parser_class=ArgumentParser)
    imports = commands.add_parser(
        "import", help="Hugging Face checkpoint -> stepjax model directory",
        description="Converts a Hugging Face Step 3.5 directory (config.json + safetensors) "
                    "into a stepjax model directory (model/weights.py).")
    imports.add_argument("source", metavar="HF_DIR")
    imports.add_argument("--out", required=True, metavar="MODEL_DIR", help="new or empty")
    imports.add_argument("--param-dtype", choices=DTYPES, default=None,
                         help="dtype of the imported params (default float32)")
    exports = commands.add_parser(
        "export", help="stepjax model directory or training workdir -> Hugging Face checkpoint",
        description="Writes a Hugging Face Step 3.5 directory from a stepjax model directory or "
                    "a `python -m train` workdir (its latest checkpoint).")
    exports.add_argument("source", metavar="DIR")
    exports.add_argument("--out", required=True, metavar="HF_DIR", help="new or empty")
    exports.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                         help="tensor dtype in the files (default: the params' dtype)")
    exports.add_argument("--max-shard-gib", type=float, default=5.0, metavar="GIB",
                         help="largest shard file (default 5)")
    args = parser.parse_args(argv)
    from model.interop.workdir import CheckpointError  # a workdir's unreadable checkpoint

    try:
        weights.check_fresh(Path(args.out))  # before the long load: nothing is overwritten
        if args.command == "import":
            config, variables = load_hf_checkpoint(args.source, param_dtype=args.param_dtype)
            weights.save_model_dir(config, variables, args.out)
        else:
            if args.max_shard_gib <= 0:
                raise ValueError(f"--max-shard-gib must be > 0, got {args.max_shard_gib}")
            config, variables = weights.load_model(args.source)
            save_hf_checkpoint(config, variables, args.out, dtype=args.dtype,
                               max_shard_bytes=int(args.max_shard_gib * 2**30))
    except (ValueError, OSError, CheckpointError) as err:
        return report_error(err)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
