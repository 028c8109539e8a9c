"""The config.json checks every checkpoint family's translation starts with (one-line
`CheckpointFormatError`s naming the key)."""

from __future__ import annotations

from typing import Any, Mapping

from model.config.model_config import MAX_LAYERS
from model.interop.safetensors_io import CheckpointFormatError


# The types of the config.json keys the families read as numbers or switches (each may be
# null where the family has a default); checked before any translation computes with them.
INTEGER_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "num_attention_groups", "head_dim", "v_head_dim",
    "intermediate_size", "moe_intermediate_size", "share_expert_dim", "sliding_window",
    "sliding_window_size", "num_nextn_predict_layers", "num_experts_per_tok", "n_routed_experts",
    "moe_num_experts", "moe_top_k", "n_group", "topk_group", "q_lora_rank", "o_lora_rank",
    "o_groups", "num_hash_layers", "index_topk", "index_n_heads", "index_head_dim", "hc_mult",
    "hc_sinkhorn_iters", "max_position_embeddings")
NUMBER_KEYS = ("rms_norm_eps", "layernorm_epsilon", "routed_scaling_factor",
               "moe_router_scaling_factor", "hc_eps", "attention_value_scale",
               "compress_rope_theta", "swiglu_limit", "partial_rotary_factor")
BOOLEAN_KEYS = ("tie_word_embeddings", "use_qk_norm", "use_moe_router_bias",
                "use_head_wise_attn_gate", "norm_topk_prob", "norm_expert_weight")


def check_types(hf: Mapping[str, Any]) -> None:
    """The keys above, where present and not null, hold values of their type."""
    for keys, wanted, fits in (
            (INTEGER_KEYS, "an integer", lambda v: type(v) is int),
            (NUMBER_KEYS, "a number", lambda v: type(v) in (int, float)),
            (BOOLEAN_KEYS, "true or false", lambda v: type(v) is bool)):
        for key in keys:
            if hf.get(key) is not None and not fits(hf[key]):
                raise CheckpointFormatError(f"{key}: expected {wanted}, got {hf[key]!r}")
    layers = hf.get("num_hidden_layers") or 1  # per-layer lists are built from it
    if not 0 < layers <= MAX_LAYERS:
        raise CheckpointFormatError(f"num_hidden_layers: expected 1 to {MAX_LAYERS}, got {layers}")


def check_family(hf: Mapping[str, Any], model_type: str,
                 required_values: Mapping[str, tuple]) -> None:
    """`hf` is a config.json of `model_type` whose keys in `required_values` hold one of the
    allowed values (the first is the default when the key is absent), and whose numbers and
    switches have their types (`check_types`)."""
    if hf.get("model_type") != model_type:
        raise CheckpointFormatError(
            f"model_type: expected {model_type!r}, got {hf.get('model_type')!r}")
    check_types(hf)
    for key, allowed in required_values.items():
        if hf.get(key, allowed[0]) not in allowed:
            raise CheckpointFormatError(f"{key}: {hf[key]!r} is not supported "
                                        f"(stepjax implements {allowed[0]!r})")


def required(values: Mapping[str, Any], key: str, prefix: str = "") -> Any:
    """values[key], which config.json must give (not null)."""
    if values.get(key) is None:
        raise CheckpointFormatError(f"{prefix}{key}: missing from config.json")
    return values[key]
