"""The config.json keys of DeepSeek-V4's own release, folded into the ones transformers (>= 5.24)
saves, as `DeepseekV4Config.__post_init__` folds them (model/interop/deepseek_v4_config.py reads
only the latter):

    compress_ratios [0 | 4 | 128 per layer]  -> layer_types (sliding / CSA / HCA)
    compress_rate_csa, compress_rate_hca     -> compress_rates
    num_hash_layers                          -> mlp_layer_types (that many hash_moe first)
    qk_rope_head_dim                         -> partial_rotary_factor = it / head_dim
    rope_scaling {type: yarn, ...}           -> rope_parameters (the flat form)

Where transformers lets one key silently win over the other, a config giving both with different
meanings is refused here, naming the release's key.
"""

from __future__ import annotations

from typing import Any, Mapping

from model.interop.config_json import required
from model.interop.safetensors_io import CheckpointFormatError

# transformers' reading of the per-layer ratios: a type, not a rate (the rates come from
# compress_rates / compress_rate_*, default 4 and 128).
_RATIO_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention",
                128: "heavily_compressed_attention"}
_RATE_KEYS = {"compress_rate_csa": "compressed_sparse_attention",
              "compress_rate_hca": "heavily_compressed_attention"}
_LEGACY = {"compress_ratios", *_RATE_KEYS, "num_hash_layers", "qk_rope_head_dim", "rope_scaling"}


def fold_release_keys(hf: Mapping[str, Any]) -> dict:
    """config.json `hf` with the release's keys replaced by transformers' (a copy; `hf` as it
    is when it has none of them)."""
    # null is absent, as transformers pops them
    hf = {key: value for key, value in hf.items() if value is not None or key not in _LEGACY}
    if "compress_ratios" in hf:
        _fold(hf, "compress_ratios", "layer_types", _layer_types(hf))
    for key, kind in _RATE_KEYS.items():
        if key in hf:
            rates, rate = dict(hf.get("compress_rates") or {}), hf.pop(key)
            if rates.setdefault(kind, rate) != rate:
                raise CheckpointFormatError(f"{key}: {rate} disagrees with compress_rates "
                                            f"({rates[kind]})")
            hf["compress_rates"] = rates
    if "num_hash_layers" in hf:
        count, layers = hf["num_hash_layers"], required(hf, "num_hidden_layers")
        if not isinstance(count, int) or count < 0:
            raise CheckpointFormatError(f"num_hash_layers: expected a count >= 0, got {count!r}")
        _fold(hf, "num_hash_layers", "mlp_layer_types",
              ["hash_moe"] * min(count, layers) + ["moe"] * max(0, layers - count))
    if "qk_rope_head_dim" in hf:
        rope_dims, head_dim = hf.pop("qk_rope_head_dim"), required(hf, "head_dim")
        # transformers saves it beside partial_rotary_factor, as int(head_dim * factor)
        if hf.get("partial_rotary_factor") is None:
            hf["partial_rotary_factor"] = rope_dims / head_dim
        factor = hf["partial_rotary_factor"]
        if int(head_dim * factor) != rope_dims:
            raise CheckpointFormatError(f"qk_rope_head_dim: {rope_dims} disagrees with "
                                        f"partial_rotary_factor {factor} of head_dim {head_dim}")
    if "rope_scaling" in hf:
        _fold(hf, "rope_scaling", "rope_parameters", _flat_rope(hf))
    return hf


def _fold(hf: dict, legacy: str, modern: str, value: Any) -> None:
    """hf[modern] = value, the meaning of hf[legacy] (dropped); a different hf[modern] is
    refused."""
    hf.pop(legacy)
    if hf.get(modern) is not None and hf[modern] != value:
        raise CheckpointFormatError(f"{legacy}: gives {modern} {value!r}, but config.json's "
                                    f"{modern} is {hf[modern]!r}")
    hf[modern] = value


def _layer_types(hf: Mapping) -> list[str]:
    """layer_types of the per-layer compress_ratios. The list may also cover the MTP layers
    (num_nextn_predict_layers, which neither transformers nor stepjax builds): only the first
    num_hidden_layers are the model's, as transformers reads them."""
    ratios, layers = hf["compress_ratios"], required(hf, "num_hidden_layers")
    lengths = {layers, layers + (hf.get("num_nextn_predict_layers") or 0)}
    if not isinstance(ratios, list) or len(ratios) not in lengths:
        raise CheckpointFormatError(f"compress_ratios: expected a list of {sorted(lengths)} "
                                    f"entries (num_hidden_layers [+ MTP layers]), got {ratios!r}")
    unknown = sorted({r for r in ratios if r not in _RATIO_TYPES}, key=str)
    if unknown:
        raise CheckpointFormatError(f"compress_ratios: {unknown} not supported (0, 4 and 128 "
                                    "are sliding, CSA and HCA layers)")
    return [_RATIO_TYPES[r] for r in ratios[:layers]]


def _flat_rope(hf: Mapping) -> dict:
    """The flat `rope_parameters` of a `rope_scaling` (old name `type` for `rope_type`; YaRN's
    pre-extension length from the top-level keys when the dict lacks it), as transformers'
    rope standardisation reads it."""
    scaling = hf["rope_scaling"]
    if not isinstance(scaling, Mapping):
        raise CheckpointFormatError(f"rope_scaling: expected an object, got {scaling!r}")
    flat = {key: value for key, value in scaling.items() if key != "type"}
    flat.setdefault("rope_type", scaling.get("type", "default"))
    if flat["rope_type"] == "yarn" and "original_max_position_embeddings" not in flat:
        flat["original_max_position_embeddings"] = hf.get(
            "original_max_position_embeddings", hf.get("max_position_embeddings"))
    return flat
