"""The Hugging Face checkpoint families stepjax reads and writes, by config.json's
`model_type`: one module each (model/interop/step3p5.py, deepseek_v4.py, mimo_v2_flash.py).
Adding a family means adding its module and one entry in FAMILIES."""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

from model.config import SHARED_KV_KINDS, ModelConfig
from model.interop import deepseek_v4, mimo_v2_flash, step3p5
from model.interop.safetensors_io import CheckpointFormatError
from model.interop.tensor_names import Entry


class Family(NamedTuple):
    """One checkpoint family: config.json <-> ModelConfig and its tensor-name table."""

    config_from_hf: Callable[[Mapping[str, Any]], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict]
    tensor_table: Callable[[ModelConfig, dict], list[Entry]]
    ignored_tensors: str | None = None  # regex of stored tensors an import skips
    # another name of each table name, read where the files use it (DeepSeek-V4's release)
    alternative_name: Callable[[str], str] | None = None
    # regex of the routed experts' table names, for exports in MXFP4 (DeepSeek-V4's release)
    expert_tensors: str | None = None
    # (config, config.json, stored tensor names) -> the config of what the files hold
    # (DeepSeek-V4: the MTP layers, which transformers' checkpoints lack)
    stored_config: Callable[[ModelConfig, Mapping[str, Any], Any], ModelConfig] | None = None


FAMILIES = {
    step3p5.MODEL_TYPE: Family(step3p5.config_from_hf, step3p5.config_to_hf,
                               step3p5.tensor_table),
    deepseek_v4.MODEL_TYPE: Family(deepseek_v4.config_from_hf, deepseek_v4.config_to_hf,
                                   deepseek_v4.tensor_table, None, deepseek_v4.release_name,
                                   deepseek_v4.EXPERT_TENSORS, deepseek_v4.with_stored_mtp),
    mimo_v2_flash.MODEL_TYPE: Family(mimo_v2_flash.config_from_hf, mimo_v2_flash.config_to_hf,
                                     mimo_v2_flash.tensor_table,
                                     mimo_v2_flash.IGNORED_TENSORS),
}


def checkpoint_family(model_type: Any) -> Family:
    if model_type not in FAMILIES:
        raise CheckpointFormatError(f"model_type: {model_type!r} is not supported, known "
                                    f"checkpoint families: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def model_type_of(config: ModelConfig) -> str:
    """The family a config exports to: DeepSeek-V4 when it has W/C/H layers; MiMo-V2-Flash when
    its GQA layers use what only that format holds (a sink, per-type geometry, values narrower
    than keys or scaled, group-limited routing); else Step 3.5."""
    if any(kind in SHARED_KV_KINDS for kind in config.layout):
        return deepseek_v4.MODEL_TYPE
    if mimo_v2_flash.uses_mimo_attention(config):
        return mimo_v2_flash.MODEL_TYPE
    return step3p5.MODEL_TYPE
