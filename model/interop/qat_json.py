"""The model's FP4 quantization-aware training switches (`model.qat`, model/config/qat_config.py)
in a Hugging Face config.json, so that an export imports back computing as the model did.

No published key says how a network computes with its weights: DeepSeek-V4's release announces
only how its routed experts are stored (`expert_dtype: fp4` at the top level, which
transformers' DeepseekV4Config moves into `quantization_config`); its own inference code runs
the lightning indexer's QK path in FP4 whatever the config says, and transformers' model does
not quantize it at all. So an export whose model has a switch on writes them all under their
own key, `stepjax_qat` ({"expert_weights": ..., "indexer_qk": ..., "index_scores": ...}), for
every family (transformers keeps an unknown key as a config attribute and ignores it); an
import reads it back. A config.json without it (any other checkpoint, DeepSeek-V4's release
included) imports with every switch off.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from model.config import ConfigError, ModelConfig, QATConfig, config_to_dict
from model.interop.safetensors_io import CheckpointFormatError

QAT_KEY = "stepjax_qat"


def qat_to_hf(config: ModelConfig) -> dict:
    """config.json entries recording `config.qat`: none when every switch is off."""
    if config.qat == QATConfig():
        return {}
    return {QAT_KEY: config_to_dict(config.qat)}


def with_qat_from_hf(config: ModelConfig, hf: Mapping[str, Any]) -> ModelConfig:
    """`config` (translated from config.json `hf`) with the switches `hf` records; a value that
    is not a switch, or one the model cannot take, is refused naming the key."""
    values = hf.get(QAT_KEY)
    if values is None:
        return config
    fields = {f.name for f in dataclasses.fields(QATConfig)}
    if not isinstance(values, Mapping) or set(values) - fields:
        raise CheckpointFormatError(f"{QAT_KEY}: expected an object of {sorted(fields)}, got "
                                    f"{values!r}")
    try:
        return config.replace(qat=QATConfig(**values))
    except ConfigError as err:  # named `qat.<field>`, as in ModelConfig
        field = err.field.removeprefix("qat").lstrip(".")
        raise CheckpointFormatError(f"{QAT_KEY}{'.' if field else ''}{field}: "
                                    f"{err.problem}") from None
