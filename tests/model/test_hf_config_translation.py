"""Tests of the Hugging Face Step 3.5 config.json translation (`model.interop.step3p5`):
config.json <-> ModelConfig, and unsupported values named by their config.json key.

The config.json used here is hand-written (tests/hf_step3p5_checkpoint.py, the published
format), never produced by the exporter under test.
"""

from __future__ import annotations

import pytest
from hf_step3p5_checkpoint import CFG, HF_CONFIG

from model.config import config_to_dict
from model.interop.safetensors_io import CheckpointFormatError
from model.interop.step3p5 import config_from_hf, config_to_hf

# ModelConfig fields a config.json does not carry (run-time choices).
RUNTIME_FIELDS = ("param_dtype", "compute_dtype", "attention_impl", "moe_impl", "remat_policy",
                  "scan_layers", "init_std", "ep_collective", "pipeline_microbatches",
                  "pipeline_virtual_stages")


def architecture(cfg) -> dict:
    values = config_to_dict(cfg)
    for name in RUNTIME_FIELDS:
        values.pop(name)
    for name in ("num_ep_groups", "block_size"):
        values["moe"].pop(name)
    values["mtp"].pop("share_output_head")
    return values


def test_config_json_maps_to_the_model_config_and_back():
    assert architecture(config_from_hf(HF_CONFIG)) == architecture(CFG)
    assert architecture(config_from_hf(config_to_hf(CFG))) == architecture(CFG)
    exported = config_to_hf(CFG)
    for key in set(HF_CONFIG) - {"max_position_embeddings", "torch_dtype", "bos_token_id"}:
        assert exported[key] == HF_CONFIG[key], key


@pytest.mark.parametrize("change, field", [
    ({"model_type": "llama"}, "model_type"),
    ({"rope_theta": [5e5, 1e4, 2e4, 1e4, 5e5, 1e4, 1e4, 1e4]}, "rope_theta"),
    ({"partial_rotary_factors": [0.5, 1.0, 1.0]}, "partial_rotary_factors"),
    ({"layer_types": HF_CONFIG["layer_types"][:5] + ["full_attention"] * 3}, "layer_types"),
    ({"swiglu_limits_shared": [0, 0, 0, 0, 16.0, 7.0, 0, 0]}, "swiglu_limits_shared"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"yarn_only_types": None}, "yarn_only_types"),
    ({"sink": True}, "sink"),
    ({"moe_layers_enum": "1,2,9"}, "moe_layers_enum"),
    ({"attention_other_setting": {"num_attention_heads": 6, "num_attention_groups": 4}},
     "attention_other_setting.num_attention_groups"),
])
def test_unsupported_config_values_are_named(change, field):
    with pytest.raises(CheckpointFormatError) as err:
        config_from_hf({**HF_CONFIG, **change})
    message = str(err.value)
    assert message.startswith(f"{field}:") and "\n" not in message
