"""Configs: the shared machinery (`core`: validation on construction, YAML, dotted overrides),
`ModelConfig` (`model_config`) and its reading from values and files (`files`). The names below
are the package's public interface.

    cfg = load_config("configs/tiny.yaml", overrides=["d_model=128", "moe.top_k=2"])
"""

from model.config.core import (
    Config,
    ConfigError,
    apply_overrides,
    build_dataclass,
    check_bool,
    check_choice,
    check_fraction,
    check_int,
    check_nonnegative,
    check_open_fraction,
    check_positive,
    config_to_dict,
    config_yaml,
    did_you_mean,
    dotted_names,
    parse_override,
    read_yaml,
    yaml_load,
)
from model.config.attention_config import (
    ROPE_SCALING_TYPES,
    AttentionGeometry,
    AttentionTypeConfig,
    RopeScaling,
    SharedKVAttentionConfig,
)
from model.config.qat_config import QATConfig
from model.config.model_config import (
    DTYPES,
    EP_COLLECTIVES,
    GATE_TYPES,
    GQA_KINDS,
    REMAT_POLICIES,
    ROUTER_ACTIVATIONS,
    SHARED_KV_KINDS,
    HyperConnectionConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    expand_layout,
)
from model.config.files import config_from_dict, load_config, model_values

__all__ = [
    "Config", "ConfigError", "apply_overrides", "build_dataclass", "check_bool", "check_choice",
    "check_fraction", "check_int", "check_nonnegative", "check_open_fraction", "check_positive",
    "config_to_dict", "config_yaml", "did_you_mean", "dotted_names",
    "parse_override", "read_yaml", "yaml_load",
    "DTYPES", "EP_COLLECTIVES", "GATE_TYPES", "GQA_KINDS", "REMAT_POLICIES",
    "ROPE_SCALING_TYPES", "ROUTER_ACTIVATIONS", "SHARED_KV_KINDS", "AttentionGeometry", "AttentionTypeConfig",
    "HyperConnectionConfig", "ModelConfig", "MoEConfig", "MTPConfig", "QATConfig", "RopeScaling",
    "SharedKVAttentionConfig", "config_from_dict", "expand_layout", "load_config", "model_values",
]
