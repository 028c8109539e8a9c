"""config.json <-> ModelConfig for the MiMo-V2-Flash checkpoint family (`model_type:
mimo_v2_flash`, model/interop/mimo_v2_flash.py), as transformers' (>= 5.24) `MiMoV2FlashConfig`
reads and saves it.

The format fixes what stepjax keeps per attention type (`ModelConfig.attention_geometry`):
both types have `num_attention_heads` query heads and the same Q/K (`head_dim`) and value
(`v_head_dim`) widths; full-attention layers have `num_key_value_heads` KV heads and no
gate, sliding-window layers twice the KV heads and the learnable sink. `layer_types` gives the
F/S layout, `mlp_layer_types` the dense / MoE layers, `rope_parameters` one RoPE per type.
Values are multiplied by `attention_value_scale`; there is no QK norm and no shared expert;
routing is sigmoid with the loss-free bias (`e_score_correction_bias`), optionally limited to
`topk_group` of `n_group` expert groups. `sliding_window` counts the query (transformers masks
kv > q - sliding_window), which is stepjax's `window`.

The original release's config.json (read by its own modelling code) names some of this
differently; where transformers' key is absent its equivalent is read (`hybrid_layer_pattern`
1 = sliding, `moe_layer_freq` 1 = MoE, `rope_theta` / `swa_rope_theta` / `partial_rotary_factor`,
`sliding_window_size` + 1, `layernorm_epsilon`) and its per-type geometry keys (`swa_*`,
`add_*_sink_bias`) must agree with what transformers builds. transformers builds no
multi-token-prediction layers, so `mtp.num_heads` is 0 both ways. Keys that do not change the
network (token ids, max_position_embeddings, dtype, ...) are ignored on import.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from model.config import AttentionTypeConfig, ConfigError, ModelConfig, MoEConfig, MTPConfig
from model.interop.config_json import check_family, required
from model.interop.safetensors_io import CheckpointFormatError

MODEL_TYPE = "mimo_v2_flash"
_LAYER_TYPES = {"full_attention": "F", "sliding_attention": "S"}
_HF_LAYER_TYPES = {code: name for name, code in _LAYER_TYPES.items()}
# config.json entries whose other values change the network in ways stepjax (or transformers'
# modelling) does not implement (first allowed value = the default when the key is absent).
_REQUIRED_VALUES = {
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "n_shared_experts": (None, 0),  # MiMoV2FlashMoE has no shared expert
    "scoring_func": ("sigmoid",),  # the release's keys; transformers' router is sigmoid only
    "topk_method": ("noaux_tc",),
    "attention_projection_layout": ("split",),  # separate q/k/v_proj tensors
    "add_full_attention_sink_bias": (False,),
    "add_swa_attention_sink_bias": (True,),  # transformers builds the sink on SWA layers
}
# transformers' defaults where config.json gives neither its key nor the release's.
_DEFAULT_ROPE = {"full_attention": 5_000_000.0, "sliding_attention": 10_000.0}
_DEFAULT_ROTARY = 0.334


def uses_mimo_attention(cfg: ModelConfig) -> bool:
    """Whether GQA layers use what a Step 3.5 checkpoint cannot hold and this format can: a
    sink, per-type geometry, values narrower than keys or scaled, group-limited routing."""
    per_type = any(getattr(getattr(cfg, name), field) is not None
                   for name in ("full_attention", "swa_attention")
                   for field in ("num_kv_heads", "head_dim", "v_head_dim", "gate"))
    return (per_type or cfg.gate == "sink" or cfg.value_scale != 1.0
            or (cfg.v_head_dim or cfg.head_dim) != cfg.head_dim
            or cfg.moe.topk_groups != cfg.moe.num_groups)


# ---- config.json -> ModelConfig ----------------------------------------------------------------


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig of a MiMo-V2-Flash config.json: the architecture from the file, runtime
    fields (dtypes, kernels, scan, remat, ...) at their defaults. MoE layers come back as
    `num_dense_layers` when they are a suffix of the stack, else as `moe_layers`."""
    check_family(hf, MODEL_TYPE, _REQUIRED_VALUES)
    num_layers = required(hf, "num_hidden_layers")
    heads, kv_heads = required(hf, "num_attention_heads"), required(hf, "num_key_value_heads")
    head_dim, v_head_dim = required(hf, "head_dim"), required(hf, "v_head_dim")
    _check_release_geometry(hf, heads, 2 * kv_heads, head_dim, v_head_dim)
    moe_layers = [i for i, kind in enumerate(_mlp_layer_types(hf, num_layers)) if kind]
    dense = num_layers - len(moe_layers)
    suffix = moe_layers == list(range(dense, num_layers))
    rope = _rope_parameters(hf, head_dim)
    scale = hf.get("attention_value_scale", 0.707)
    try:
        return ModelConfig(
            vocab_size=required(hf, "vocab_size"), d_model=required(hf, "hidden_size"),
            num_layers=num_layers, layout=_layout(hf, num_layers), window=_window(hf),
            head_dim=head_dim, v_head_dim=v_head_dim, num_kv_heads=kv_heads,
            full_attention=AttentionTypeConfig(num_heads=heads, **rope["full_attention"]),
            swa_attention=AttentionTypeConfig(num_heads=heads, num_kv_heads=2 * kv_heads,
                                              gate="sink", **rope["sliding_attention"]),
            gate="none", qk_norm=False, value_scale=1.0 if scale is None else float(scale),
            num_dense_layers=dense if suffix else 0,
            moe_layers=None if suffix else tuple(moe_layers),
            dense_hidden=required(hf, "intermediate_size"), moe=_moe_from_hf(hf),
            mtp=MTPConfig(num_heads=0), tie_embeddings=hf.get("tie_word_embeddings", False),
            norm_eps=float(_norm_eps(hf)))
    except ConfigError as err:
        raise CheckpointFormatError(f"config.json gives an invalid stepjax config: {err}") from None


def _per_layer(hf: Mapping, key: str, num_layers: int) -> list | None:
    values = hf.get(key)
    if values is not None and (not isinstance(values, list) or len(values) != num_layers):
        raise CheckpointFormatError(f"{key}: expected a list of num_hidden_layers={num_layers} "
                                    f"entries, got {values!r}")
    return values


def _agreeing(hf: Mapping, key: str, release_key: str, num_layers: int,
              release: Mapping) -> list | None:
    """Per-layer list `key`, else the release's `release_key` with its values named as in
    `release`; both given must agree. None when neither is."""
    ours, theirs = _per_layer(hf, key, num_layers), _per_layer(hf, release_key, num_layers)
    if theirs is not None:
        theirs = [release.get(value, value) for value in theirs]  # unknown values kept, named
        if ours is not None and ours != theirs:
            raise CheckpointFormatError(f"{release_key}: disagrees with {key} ({theirs} against "
                                        f"{ours})")
    return theirs if ours is None else ours


def _layout(hf: Mapping, num_layers: int) -> str:
    """transformers' default: full attention on layer 0 and every sixth layer (5, 11, ...)."""
    names = _agreeing(hf, "layer_types", "hybrid_layer_pattern", num_layers,
                      {0: "full_attention", 1: "sliding_attention"})
    if names is None:
        names = ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
                 for i in range(num_layers)]
    unknown = sorted({n for n in names if n not in _LAYER_TYPES})
    if unknown:
        raise CheckpointFormatError(f"layer_types: unknown {unknown}, expected "
                                    f"{list(_LAYER_TYPES)}")
    return "".join(_LAYER_TYPES[n] for n in names)


def _mlp_layer_types(hf: Mapping, num_layers: int) -> list[bool]:
    """True for each MoE layer; transformers' default: every layer but the first."""
    names = _agreeing(hf, "mlp_layer_types", "moe_layer_freq", num_layers,
                      {0: "dense", 1: "sparse"})
    if names is None:
        names = ["dense"] + ["sparse"] * (num_layers - 1)
    unknown = sorted({n for n in names if n not in ("dense", "sparse")})
    if unknown:
        raise CheckpointFormatError(f"mlp_layer_types: unknown {unknown}, expected "
                                    "['dense', 'sparse']")
    return [n == "sparse" for n in names]


def _window(hf: Mapping) -> int:
    # MiMoV2FlashConfig: sliding_window = sliding_window_size + 1 when the latter is given
    if hf.get("sliding_window_size") is not None:
        return hf["sliding_window_size"] + 1
    return required(hf, "sliding_window")


def _norm_eps(hf: Mapping) -> float:
    if hf.get("rms_norm_eps") is not None and hf.get("layernorm_epsilon") is not None and (
            hf["rms_norm_eps"] != hf["layernorm_epsilon"]):
        raise CheckpointFormatError(f"layernorm_epsilon: {hf['layernorm_epsilon']} disagrees "
                                    f"with rms_norm_eps {hf['rms_norm_eps']}")
    return hf.get("rms_norm_eps", hf.get("layernorm_epsilon", 1e-5))


def _check_release_geometry(hf: Mapping, heads: int, swa_kv_heads: int, head_dim: int,
                            v_head_dim: int) -> None:
    """The release's per-type keys, where given, must be what transformers builds."""
    for key, built in (("swa_num_attention_heads", heads), ("swa_num_key_value_heads",
                                                            swa_kv_heads),
                       ("swa_head_dim", head_dim), ("swa_v_head_dim", v_head_dim)):
        if hf.get(key, built) != built:
            raise CheckpointFormatError(f"{key}: {hf[key]} is not supported; transformers' "
                                        f"MiMoV2FlashForCausalLM builds {built} from the "
                                        "full-attention keys")


def _rope_parameters(hf: Mapping, head_dim: int) -> dict[str, dict]:
    """{layer type: AttentionTypeConfig RoPE fields} from `rope_parameters`, else the release's
    `rope_theta` / `swa_rope_theta` / `partial_rotary_factor`, else transformers' defaults."""
    params = hf.get("rope_parameters")
    if params is None:
        rotary = hf.get("partial_rotary_factor", _DEFAULT_ROTARY)
        params = {"full_attention": {"rope_theta": hf.get("rope_theta",
                                                          _DEFAULT_ROPE["full_attention"]),
                                     "partial_rotary_factor": rotary},
                  "sliding_attention": {"rope_theta": hf.get(
                      "swa_rope_theta", _DEFAULT_ROPE["sliding_attention"]),
                      "partial_rotary_factor": rotary}}
    fields = {}
    for layer_type in _LAYER_TYPES:
        prefix = f"rope_parameters.{layer_type}."
        sub = params.get(layer_type) if isinstance(params, Mapping) else None
        if not isinstance(sub, Mapping):
            raise CheckpointFormatError(f"rope_parameters.{layer_type}: missing from config.json")
        if sub.get("rope_type", "default") != "default":
            raise CheckpointFormatError(f"{prefix}rope_type: {sub['rope_type']!r} is not "
                                        "supported; stepjax reads plain RoPE ('default')")
        fields[layer_type] = dict(
            rope_theta=float(required(sub, "rope_theta", prefix)),
            partial_rotary_factor=float(sub.get("partial_rotary_factor", _DEFAULT_ROTARY)))
    return fields


def _moe_from_hf(hf: Mapping) -> MoEConfig:
    num_experts = required(hf, "n_routed_experts")
    scaling = hf.get("routed_scaling_factor")  # null in the release: 1.0 (MiMoV2FlashConfig)
    return MoEConfig(
        num_experts=num_experts, top_k=required(hf, "num_experts_per_tok"),
        expert_hidden=required(hf, "moe_intermediate_size"), num_shared_experts=0,
        router_activation="sigmoid", router_bias=True,
        renormalize=hf.get("norm_topk_prob", True),
        routed_scaling_factor=1.0 if scaling is None else float(scaling),
        # G of the balance loss (eq. 1) is a training choice the checkpoint does not carry:
        # the default, or a divisor of the expert count.
        num_ep_groups=math.gcd(MoEConfig.num_ep_groups, num_experts),
        num_groups=hf.get("n_group", 1), topk_groups=hf.get("topk_group", 1))


# ---- ModelConfig -> config.json ----------------------------------------------------------------


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json of `cfg`, such that `MiMoV2FlashConfig(**json)` builds the same network;
    configs it cannot express are refused with the field that prevents it."""
    _check_exportable(cfg)
    full, swa = cfg.attention_geometry("F"), cfg.attention_geometry("S")
    rope = {_HF_LAYER_TYPES[kind]: {"rope_type": "default", "rope_theta": geo.rope_theta,
                                    "partial_rotary_factor": cfg.attention_config(
                                        kind).partial_rotary_factor}
            for kind, geo in (("F", full), ("S", swa))}
    moe = cfg.moe
    return {
        "model_type": MODEL_TYPE, "architectures": ["MiMoV2FlashForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "layer_types": [_HF_LAYER_TYPES[kind] for kind in cfg.layout],
        "mlp_layer_types": ["sparse" if cfg.is_moe_layer(i) else "dense"
                            for i in range(cfg.num_layers)],
        "num_attention_heads": full.num_heads, "num_key_value_heads": full.num_kv_heads,
        "head_dim": full.head_dim, "v_head_dim": full.v_head_dim,
        "sliding_window": cfg.window, "rope_parameters": rope,
        "attention_value_scale": cfg.value_scale, "intermediate_size": cfg.dense_hidden,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_hidden, "n_group": moe.num_groups,
        "topk_group": moe.topk_groups, "norm_topk_prob": moe.renormalize,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "hidden_act": "silu", "attention_bias": False,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
    }


def _check_exportable(cfg: ModelConfig) -> None:
    full, swa, moe = cfg.attention_geometry("F"), cfg.attention_geometry("S"), cfg.moe
    problems = (
        ("layout", any(kind not in _HF_LAYER_TYPES for kind in cfg.layout),
         f"{cfg.layout!r} has DeepSeek-V4 layers (W/C/H); MiMo-V2-Flash has F/S only"),
        ("hyper_connections.hc_mult", cfg.hyper_connections.hc_mult != 1,
         "MiMo-V2-Flash has a plain residual stream (no mHC)"),
        ("swa_attention.num_heads", swa.num_heads != full.num_heads,
         f"{swa.num_heads} differs from full_attention's {full.num_heads}; MiMo-V2-Flash has "
         "one query-head count"),
        ("swa_attention.num_kv_heads", swa.num_kv_heads != 2 * full.num_kv_heads,
         f"{swa.num_kv_heads}; MiMo-V2-Flash's SWA layers have twice the full layers' "
         f"{full.num_kv_heads}"),
        ("swa_attention.head_dim", swa.head_dim != full.head_dim,
         f"{swa.head_dim} differs from full_attention's {full.head_dim}"),
        ("swa_attention.v_head_dim", swa.v_head_dim != full.v_head_dim,
         f"{swa.v_head_dim} differs from full_attention's {full.v_head_dim}"),
        ("full_attention.gate", full.gate != "none",
         f"{full.gate!r}; MiMo-V2-Flash's full-attention layers have no gate or sink"),
        ("swa_attention.gate", swa.gate != "sink",
         f"{swa.gate!r}; MiMo-V2-Flash's sliding-window layers have the sink"),
        ("full_attention.rope_scaling", full.rope_scaling.type != "none",
         "context-extension scaling is not exported (plain RoPE only)"),
        ("qk_norm", cfg.qk_norm, "MiMo-V2-Flash has no QK norm"),
        ("moe.num_shared_experts", moe.num_shared_experts != 0,
         "MiMo-V2-Flash has no shared expert"),
        ("moe.router_activation", moe.router_activation != "sigmoid",
         f"{moe.router_activation!r}; MiMo-V2-Flash's router is sigmoid"),
        ("moe.router_bias", not moe.router_bias,
         "MiMo-V2-Flash's router has the loss-free bias (e_score_correction_bias)"),
        ("moe.hash_layers", moe.hash_layers != 0, "MiMo-V2-Flash has no hash-routed layers"),
        ("swiglu_limits", any(cfg.swiglu_limits) or any(cfg.swiglu_limits_shared),
         "MiMo-V2-Flash's FFNs are unclamped"),
        ("mtp.num_heads", cfg.mtp.num_heads != 0,
         "transformers' MiMoV2FlashForCausalLM has no MTP layers; export with --drop-mtp"),
    )
    for field, failed, reason in problems:
        if failed:
            raise CheckpointFormatError(f"{field}: {reason}")
