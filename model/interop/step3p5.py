"""The Step 3.5 Flash checkpoint family (`model_type: step3p5`): config.json <-> ModelConfig and
the tensor-name table (docs/architecture.md; the published Hugging Face checkpoint).

The format, as the public loaders read it: vLLM `vllm/model_executor/models/step3p5.py` and
`step3p5_mtp.py`, mlx-lm `mlx_lm/models/step3p5.py`, llama.cpp's Step3p5 converter and the
reference modeling code (mirrored in Ascend/MindSpeed-LLM
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

import math
from typing import Any, Mapping, Sequence

from model.config import AttentionTypeConfig, ModelConfig, MoEConfig, MTPConfig, RopeScaling
from model.interop.config_json import check_family, required
from model.interop.safetensors_io import CheckpointFormatError
from model.interop.tensor_names import (
    LINEAR,
    SAME,
    Entry,
    Experts,
    Linear,
    Rule,
    check_coverage,
    entry,
    layer_slots,
)

MODEL_TYPE = "step3p5"
_LAYER_TYPES = {"full_attention": "F", "sliding_attention": "S"}
_HF_LAYER_TYPES = {code: name for name, code in _LAYER_TYPES.items()}
# config.json entries whose other values change the network in ways stepjax does not implement
# (first allowed value = the default when the key is absent).
_REQUIRED_VALUES = {
    "att_impl_type": ("GQA",),
    "hidden_act": ("silu",),
    "zero_centered": (True,),  # norms applied as (1 + w)
    "sink": (False, None),  # attention-sink tensors, absent from the released model
}


# ---- config.json <-> ModelConfig ---------------------------------------------------------------


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig of a Step 3.5 config.json: the architecture from the file, runtime fields
    (dtypes, kernels, scan, remat, ...) at their defaults. MoE layers come back as
    `num_dense_layers` when they are a suffix of the stack, else as `moe_layers`."""
    check_family(hf, MODEL_TYPE, _REQUIRED_VALUES)
    if not all(hf.get("use_rope_layers") or [True]):
        raise CheckpointFormatError("use_rope_layers: layers without RoPE are not supported")
    num_layers = required(hf, "num_hidden_layers")
    num_mtp = hf.get("num_nextn_predict_layers", 0)
    types = _layer_types(hf, num_layers, num_mtp)
    moe_layers = _moe_layers_from_hf(hf, num_layers)
    dense = num_layers - len(moe_layers)
    suffix = moe_layers == list(range(dense, num_layers))
    head_dim = hf.get("head_dim") or required(hf, "hidden_size") // required(
        hf, "num_attention_heads")
    fields = dict(
        vocab_size=required(hf, "vocab_size"), d_model=required(hf, "hidden_size"),
        num_layers=num_layers, layout=types[:num_layers],
        window=hf.get("sliding_window") or ModelConfig.window,
        num_kv_heads=required(hf, "num_attention_groups"), head_dim=head_dim,
        **_attention_from_hf(hf, types, num_layers, head_dim),
        gate="headwise" if hf.get("use_head_wise_attn_gate", False) else "none",
        qk_norm=hf.get("use_qk_norm", True),
        num_dense_layers=dense if suffix else 0, moe_layers=None if suffix else tuple(moe_layers),
        dense_hidden=required(hf, "intermediate_size"), moe=_moe_from_hf(hf),
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
    heads = required(hf, "num_attention_heads")
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


def _refuse_per_type_geometry(cfg: ModelConfig) -> None:
    """The Step 3.5 format has one KV-head count, one head dim for queries, keys and values,
    one gate and no value scale or expert groups (MiMo-V2-Flash's `mimo_v2_flash` has them)."""
    for name in ("full_attention", "swa_attention"):
        type_cfg = getattr(cfg, name)
        for field in ("num_kv_heads", "head_dim", "v_head_dim", "gate"):
            if getattr(type_cfg, field) is not None:
                raise CheckpointFormatError(
                    f"{name}.{field}: per-type attention geometry has no Step 3.5 checkpoint "
                    f"equivalent; set the model-level field or export as mimo_v2_flash")
    for field, value, plain in (("value_scale", cfg.value_scale, 1.0),
                                ("v_head_dim", cfg.v_head_dim or cfg.head_dim, cfg.head_dim),
                                ("moe.topk_groups", cfg.moe.topk_groups, cfg.moe.num_groups)):
        if value != plain:
            raise CheckpointFormatError(f"{field}: {value} has no Step 3.5 checkpoint equivalent")


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json of `cfg` (per-layer lists include the MTP layers, which are SWA blocks with
    a dense, unclamped FFN: model/layers/mtp.py)."""
    if cfg.gate == "sink":
        raise CheckpointFormatError("gate: 'sink' has no Step 3.5 checkpoint equivalent; "
                                    "export models with gate 'headwise' or 'none'")
    _refuse_per_type_geometry(cfg)
    if any(kind not in _HF_LAYER_TYPES for kind in cfg.layout):
        raise CheckpointFormatError(f"layout: {cfg.layout!r} has DeepSeek-V4 layers (W/C/H), "
                                    "which a Step 3.5 checkpoint cannot hold (model_type "
                                    "deepseek_v4 can)")
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


def _check_length(field: str, values: Sequence, num_layers: int, num_mtp: int) -> None:
    if len(values) not in (num_layers, num_layers + num_mtp):
        raise CheckpointFormatError(
            f"{field}: has {len(values)} entries, expected num_hidden_layers={num_layers} "
            f"(+ num_nextn_predict_layers={num_mtp})")


def _layer_types(hf: Mapping, num_layers: int, num_mtp: int) -> str:
    """'F'/'S' per layer, MTP layers included (they must be sliding-window blocks)."""
    names = required(hf, "layer_types")
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
    # stepjax scales full-attention layers only (docs/architecture.md, Exact semantics: RoPE).
    scaled = hf.get("yarn_only_types") or list(_LAYER_TYPES)
    if "sliding_attention" in scaled and "S" in types:
        raise CheckpointFormatError(f"yarn_only_types: {scaled} scales sliding-window layers; "
                                    "stepjax supports ['full_attention'] only")
    if "full_attention" not in scaled:
        return RopeScaling()
    return RopeScaling(
        type=kind, factor=float(required(raw, "factor", "rope_scaling.")),
        original_max_len=int(required(raw, "original_max_position_embeddings", "rope_scaling.")),
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


def tensor_table(cfg: ModelConfig, abstract: dict) -> list[Entry]:
    """Every checkpoint tensor of `cfg` with its variable, in checkpoint order. `abstract`:
    unboxed variables (or their ShapeDtypeStructs); rules whose variable the model lacks drop
    out (`model.interop.tensor_names.entry`)."""
    entries = []

    def add(name: str, rule: Rule, prefix: tuple = (), index: tuple[int, ...] = ()) -> None:
        found = entry(name, rule, abstract, prefix, index)
        if found is not None:
            entries.append(found)

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
    check_coverage(abstract, entries, "Step 3.5")
    return entries
