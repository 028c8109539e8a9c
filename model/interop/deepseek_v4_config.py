"""config.json <-> ModelConfig for the DeepSeek-V4 checkpoint family (`model_type:
deepseek_v4`, model/interop/deepseek_v4.py), as transformers' (>= 5.24) `DeepseekV4Config`
reads and saves it; the release's own keys (`compress_ratios`, `num_hash_layers`, ...) are
first folded into those as transformers folds them (model/interop/deepseek_v4_release_keys.py).

Every layer is MoE with one shared expert of the routed experts' width; `layer_types` gives the
W/C/H layout, `mlp_layer_types` the hash-routed layers (a prefix), `rope_parameters` the
sliding-window (`main`) and compressed (`compress`, optionally YaRN) RoPE.
`num_nextn_predict_layers` counts the release's multi-token-prediction layers (stepjax `layer`
MTP blocks on W attention, sharing the output head); transformers builds none and its
save_pretrained writes no `mtp.*` tensors, so the import builds the MTP heads the files hold
(`with_stored_mtp`) and `config_from_hf` alone gives none. Config keys that do not change
the network (token ids, max_position_embeddings, dtype, loss coefficients, ...) are ignored on
import; values stepjax or transformers' modelling cannot honour are refused, naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

from model.config import (
    ConfigError,
    HyperConnectionConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    RopeScaling,
    SharedKVAttentionConfig,
)
from model.interop.config_json import check_family, required
from model.interop.deepseek_v4_release_keys import fold_release_keys
from model.interop.safetensors_io import CheckpointFormatError

MODEL_TYPE = "deepseek_v4"
_MTP_NAME = re.compile(r"^mtp\.(\d+)\.")
_LAYER_TYPES = {"sliding_attention": "W", "compressed_sparse_attention": "C",
                "heavily_compressed_attention": "H"}
_HF_LAYER_TYPES = {code: name for name, code in _LAYER_TYPES.items()}
# scoring_func values transformers can build (its ACT2FN has no "softmax")
_SCORING = {"sqrtsoftplus": "sqrt_softplus", "sigmoid": "sigmoid"}
_HF_SCORING = {ours: name for name, ours in _SCORING.items()}
# config.json entries whose other values stepjax (or transformers' modelling) does not
# implement (first allowed value = the default when the key is absent).
_REQUIRED_VALUES = {
    "num_key_value_heads": (1,),  # shared-KV MQA
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "n_shared_experts": (1,),  # DeepseekV4MLP builds one shared expert whatever the count
    "norm_topk_prob": (True,),  # DeepseekV4TopKRouter / HashRouter always renormalise
}
# (mscale / mscale_all_dim only enter YaRN's attention factor, which must be 1 here)
_YARN_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "factor",
              "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
              "mscale", "mscale_all_dim"}


# ---- config.json -> ModelConfig ----------------------------------------------------------------


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig of a DeepSeek-V4 config.json: the architecture from the file, runtime fields
    (dtypes, kernels, scan, remat, ...) at their defaults. Every layer is an MoE layer; the
    hash-routed ones (`mlp_layer_types` "hash_moe") must come first."""
    check_family(hf, MODEL_TYPE, _REQUIRED_VALUES)
    hf = fold_release_keys(hf)
    num_layers = required(hf, "num_hidden_layers")
    hc_mult = required(hf, "hc_mult")
    if hc_mult < 2:
        raise CheckpointFormatError(f"hc_mult: {hc_mult} is not supported; transformers builds "
                                    "hyper-connections even for 1 stream, stepjax only for >= 2")
    limit = float(required(hf, "swiglu_limit"))
    if limit <= 0:
        raise CheckpointFormatError(f"swiglu_limit: {limit} is not supported; transformers "
                                    "clamps with it unconditionally, stepjax's 0 means no clamp")
    try:
        return ModelConfig(
            vocab_size=required(hf, "vocab_size"), d_model=required(hf, "hidden_size"),
            num_layers=num_layers, layout=_layout(hf, num_layers),
            window=required(hf, "sliding_window"), gate="none",
            shared_kv_attention=_attention_from_hf(hf),
            hyper_connections=HyperConnectionConfig(
                hc_mult=hc_mult, sinkhorn_iters=required(hf, "hc_sinkhorn_iters"),
                eps=float(required(hf, "hc_eps"))),
            num_dense_layers=0, moe=_moe_from_hf(hf, num_layers),
            # DeepseekV4MLP clamps the shared expert with the routed experts' limit
            swiglu_limits=limit, swiglu_limits_shared=limit, swiglu_gate_clamp="before_silu",
            mtp=MTPConfig(num_heads=0, attention_type="W", block="layer",
                          share_output_head=True),
            tie_embeddings=hf.get("tie_word_embeddings", False),
            norm_eps=float(required(hf, "rms_norm_eps")))
    except ConfigError as err:
        raise CheckpointFormatError(f"config.json gives an invalid stepjax config: {err}") from None


def _per_layer(hf: Mapping, key: str, num_layers: int, allowed) -> list:
    names = required(hf, key)
    if not isinstance(names, list) or len(names) != num_layers:
        raise CheckpointFormatError(f"{key}: expected a list of num_hidden_layers={num_layers} "
                                    f"entries, got {names!r}")
    unknown = sorted({n for n in names if n not in allowed})
    if unknown:
        raise CheckpointFormatError(f"{key}: unknown {unknown}, expected {list(allowed)}")
    return names


def _layout(hf: Mapping, num_layers: int) -> str:
    return "".join(_LAYER_TYPES[n] for n in _per_layer(hf, "layer_types", num_layers,
                                                        _LAYER_TYPES))


def _hash_layers(hf: Mapping, num_layers: int) -> int:
    """How many leading layers are hash-routed (stepjax hashes the first MoE layers)."""
    kinds = _per_layer(hf, "mlp_layer_types", num_layers, ("hash_moe", "moe"))
    count = next((i for i, kind in enumerate(kinds) if kind == "moe"), num_layers)
    if "hash_moe" in kinds[count:]:
        raise CheckpointFormatError(f"mlp_layer_types: the hash_moe layers must come first, "
                                    f"got {kinds}")
    return count


def _moe_from_hf(hf: Mapping, num_layers: int) -> MoEConfig:
    num_experts = required(hf, "n_routed_experts")
    scoring = required(hf, "scoring_func")
    if scoring not in _SCORING:
        raise CheckpointFormatError(f"scoring_func: {scoring!r} is not supported, expected one "
                                    f"of {list(_SCORING)}")
    hidden = required(hf, "moe_intermediate_size")
    return MoEConfig(
        num_experts=num_experts, top_k=required(hf, "num_experts_per_tok"),
        expert_hidden=hidden, num_shared_experts=1, shared_hidden=hidden,
        router_activation=_SCORING[scoring], router_bias=True, renormalize=True,
        routed_scaling_factor=float(required(hf, "routed_scaling_factor")),
        # G of the balance loss (eq. 1) is a training choice the checkpoint does not carry:
        # the default, or a divisor of the expert count.
        num_ep_groups=math.gcd(MoEConfig.num_ep_groups, num_experts),
        hash_layers=_hash_layers(hf, num_layers))


def _attention_from_hf(hf: Mapping) -> SharedKVAttentionConfig:
    head_dim = required(hf, "head_dim")
    main, compress = _rope_parameters(hf)
    if main.get("rope_type", "default") != "default":
        raise CheckpointFormatError(f"rope_parameters.main.rope_type: {main['rope_type']!r} is "
                                    "not supported; sliding-window layers use plain RoPE")
    rope_dims = {int(head_dim * sub.get("partial_rotary_factor", 1.0))
                 for sub in (main, compress)}
    if len(rope_dims) > 1:
        raise CheckpointFormatError("rope_parameters: main and compress rotate different "
                                    f"numbers of dims {sorted(rope_dims)}; stepjax shares one")
    rates = {"compressed_sparse_attention": SharedKVAttentionConfig.csa_rate,
             "heavily_compressed_attention": SharedKVAttentionConfig.hca_rate,
             **(hf.get("compress_rates") or {})}
    return SharedKVAttentionConfig(
        num_heads=required(hf, "num_attention_heads"), head_dim=head_dim,
        rope_dims=rope_dims.pop(), q_lora_rank=required(hf, "q_lora_rank"),
        o_groups=required(hf, "o_groups"), o_lora_rank=required(hf, "o_lora_rank"),
        rope_theta=float(required(main, "rope_theta", "rope_parameters.main.")),
        compress_rope_theta=float(required(compress, "rope_theta", "rope_parameters.compress.")),
        compress_rope_scaling=_compress_scaling(compress),
        csa_rate=rates["compressed_sparse_attention"],
        hca_rate=rates["heavily_compressed_attention"],
        index_heads=required(hf, "index_n_heads"), index_head_dim=required(hf, "index_head_dim"),
        index_topk=required(hf, "index_topk"))


def _rope_parameters(hf: Mapping) -> tuple[dict, dict]:
    """(main, compress) RoPE settings: the nested `rope_parameters` transformers saves, or the
    flat form DeepseekV4Config.__post_init__ nests (its keys are the compress layers' scaling,
    with YaRN's attention factor forced to 1)."""
    params = hf.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return dict(params["main"]), dict(params["compress"])
    rotary = required(hf, "partial_rotary_factor")
    main = {"rope_type": "default", "rope_theta": required(hf, "rope_theta"),
            "partial_rotary_factor": rotary}
    compress = {"rope_type": "default", **params,
                "rope_theta": required(hf, "compress_rope_theta"),
                "partial_rotary_factor": rotary}
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress


def _compress_scaling(compress: Mapping) -> RopeScaling:
    prefix = "rope_parameters.compress."
    kind = compress.get("rope_type", "default")
    if kind == "default":
        return RopeScaling()
    if kind != "yarn":
        raise CheckpointFormatError(f"{prefix}rope_type: {kind!r} is not supported, expected "
                                    "'default' or 'yarn'")
    unknown = sorted(set(compress) - _YARN_KEYS)
    if unknown:
        raise CheckpointFormatError(f"{prefix}{unknown[0]}: not supported with yarn scaling")
    # The compressed layers ignore YaRN's cos/sin multiplier (model/layers/shared_kv_attention.py),
    # as transformers does once attention_factor is 1.
    if compress.get("attention_factor") != 1.0:
        raise CheckpointFormatError(f"{prefix}attention_factor: {compress.get('attention_factor')!r}"
                                    " is not supported; stepjax implements 1.0")
    return RopeScaling(
        type="yarn", factor=float(required(compress, "factor", prefix)),
        original_max_len=int(required(compress, "original_max_position_embeddings", prefix)),
        beta_fast=float(compress.get("beta_fast") or 32.0),
        beta_slow=float(compress.get("beta_slow") or 1.0))


# ---- ModelConfig -> config.json ----------------------------------------------------------------


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json of `cfg`, such that `DeepseekV4Config(**json)` builds the same network;
    configs it cannot express are refused with the field that prevents it."""
    _check_exportable(cfg)
    attn, moe, hc = cfg.shared_kv_attention, cfg.moe, cfg.hyper_connections
    rotary = attn.rope_dims / attn.head_dim
    compress = {"rope_type": "default", "rope_theta": attn.compress_rope_theta,
                "partial_rotary_factor": rotary}
    scaling = attn.compress_rope_scaling
    if scaling.type == "yarn":
        compress.update(rope_type="yarn", factor=scaling.factor,
                        original_max_position_embeddings=scaling.original_max_len,
                        beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow,
                        attention_factor=1.0)
    return {
        "model_type": MODEL_TYPE, "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "layer_types": [_HF_LAYER_TYPES[kind] for kind in cfg.layout],
        "mlp_layer_types": ["hash_moe" if cfg.is_hash_layer(i) else "moe"
                            for i in range(cfg.num_layers)],
        "num_attention_heads": attn.num_heads, "num_key_value_heads": 1,
        "head_dim": attn.head_dim, "q_lora_rank": attn.q_lora_rank,
        "o_groups": attn.o_groups, "o_lora_rank": attn.o_lora_rank,
        "index_n_heads": attn.index_heads, "index_head_dim": attn.index_head_dim,
        "index_topk": attn.index_topk, "sliding_window": cfg.window,
        "compress_rates": {"compressed_sparse_attention": attn.csa_rate,
                           "heavily_compressed_attention": attn.hca_rate},
        "partial_rotary_factor": rotary, "rope_theta": attn.rope_theta,
        "compress_rope_theta": attn.compress_rope_theta,
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": attn.rope_theta,
                                     "partial_rotary_factor": rotary},
                            "compress": compress},
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_hidden, "n_shared_experts": 1,
        "scoring_func": _HF_SCORING[moe.router_activation], "norm_topk_prob": True,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "swiglu_limit": cfg.swiglu_limits[0],
        "hc_mult": hc.hc_mult, "hc_sinkhorn_iters": hc.sinkhorn_iters, "hc_eps": hc.eps,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "num_nextn_predict_layers": cfg.mtp.num_heads,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
    }


def _check_exportable(cfg: ModelConfig) -> None:
    attn, moe = cfg.shared_kv_attention, cfg.moe
    mtp = (cfg.mtp.block, cfg.mtp.attention_type, cfg.mtp.share_output_head)
    problems = (
        ("layout", any(kind not in _HF_LAYER_TYPES for kind in cfg.layout),
         f"{cfg.layout!r} has Step 3.5 GQA layers (F/S); DeepSeek-V4 has W/C/H only"),
        ("num_dense_layers", cfg.num_moe_layers != cfg.num_layers,
         "every DeepSeek-V4 layer is an MoE layer; export models without dense layers"),
        ("moe.num_shared_experts",
         moe.num_shared_experts != 1 or moe.shared_hidden != moe.expert_hidden,
         "DeepSeek-V4 has one shared expert of moe.expert_hidden; got "
         f"{moe.num_shared_experts} of {moe.shared_hidden}"),
        ("moe.router_activation", moe.router_activation not in _HF_SCORING,
         f"{moe.router_activation!r} has no transformers scoring_func"),
        ("moe.router_bias", not moe.router_bias, "DeepSeek-V4's learned routers have a bias"),
        ("moe.renormalize", not moe.renormalize,
         "transformers' DeepSeek-V4 routers always renormalise"),
        ("swiglu_gate_clamp", cfg.swiglu_gate_clamp != "before_silu",
         "DeepSeek-V4 caps the gate before the SiLU ('before_silu')"),
        ("swiglu_limits", len({*cfg.swiglu_limits, *cfg.swiglu_limits_shared}) != 1
         or cfg.swiglu_limits[0] <= 0,
         "DeepSeek-V4 has one clamp > 0 (swiglu_limit) for every routed and shared expert"),
        ("hyper_connections.hc_mult", cfg.hyper_connections.hc_mult < 2,
         "transformers always builds mHC, stepjax only for hc_mult >= 2"),
        ("mtp.block", cfg.mtp.num_heads > 0 and mtp != ("layer", "W", True),
         "DeepSeek-V4's MTP layers are full decoder layers on sliding-window attention sharing "
         "the output head (mtp.block=layer, mtp.attention_type=W, mtp.share_output_head=true); "
         "export without them with --drop-mtp"),
        ("shared_kv_attention.compress_rope_scaling",
         attn.compress_rope_scaling.type not in ("none", "yarn"), "only yarn has an equivalent"),
        ("shared_kv_attention.rope_dims",
         int(attn.head_dim * (attn.rope_dims / attn.head_dim)) != attn.rope_dims,
         "not expressible as partial_rotary_factor * head_dim"),
    )
    for field, failed, reason in problems:
        if failed:
            raise CheckpointFormatError(f"{field}: {reason}")


def with_stored_mtp(config: ModelConfig, hf: Mapping[str, Any], names) -> ModelConfig:
    """`config` with the MTP heads whose `mtp.{i}.*` tensors the files hold (none in what
    transformers saves: it drops them): `num_nextn_predict_layers` of them, on the sliding-window
    layers the release's `compress_ratios` gives them (its entries past num_hidden_layers)."""
    stored = sorted({int(m.group(1)) for name in names if (m := _MTP_NAME.match(name))})
    if not stored:
        return config
    heads = hf.get("num_nextn_predict_layers") or 0
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 0:
        raise CheckpointFormatError(f"num_nextn_predict_layers: expected a count >= 0, got "
                                    f"{heads!r}")
    if len(stored) != heads or stored[-1] != heads - 1:  # (sorted, distinct: 0..heads-1)
        raise CheckpointFormatError(f"num_nextn_predict_layers: {heads}, but the files hold MTP "
                                    f"layers {stored} (mtp.{{i}}.* tensors)")
    ratios = (hf.get("compress_ratios") or [])[config.num_layers:]
    if any(ratio != 0 for ratio in ratios):
        raise CheckpointFormatError(f"compress_ratios: the MTP layers' {ratios} are not "
                                    "supported (stepjax builds sliding-window MTP layers, 0)")
    return config.replace(mtp=dataclasses.replace(config.mtp, num_heads=heads))
