"""DeepSeek-V4 attention layers (W / C / H) added to another family's preset take sizes scaled to
the host model (model.config.attention_config.host_shared_kv_sizes) instead of V4-Flash's
full-size defaults; what a config gives is kept, presets that give everything are unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from model.config import ModelConfig, config_from_dict, config_to_dict, load_config
from model.config.attention_config import SharedKVAttentionConfig
from model.summary import count_params

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "tiny.yaml"
SIZES = ("num_heads", "head_dim", "rope_dims", "q_lora_rank", "o_groups", "o_lora_rank",
         "index_heads", "index_head_dim")


def sizes(config: ModelConfig) -> dict[str, int]:
    return {name: getattr(config.shared_kv_attention, name) for name in SIZES}


def test_csa_layers_on_the_tiny_preset_stay_tiny():
    # The README's mix example. tiny.yaml: d_model 128, full layers 4 heads of 32, RoPE on half.
    mixed = load_config(TINY, ["layout=F+SSSC*2"])
    assert sizes(mixed) == {"num_heads": 4, "head_dim": 4 * 32, "rope_dims": 16,
                            "q_lora_rank": 128 // 4, "o_groups": 4, "o_lora_rank": 128 // 4,
                            "index_heads": 4, "index_head_dim": 32}
    host, total = count_params(load_config(TINY))["total"], count_params(mixed)["total"]
    # Two SWA layers became CSA: a few percent more, where V4-Flash's sizes made it 31x.
    assert host < total < 1.1 * host, (host, total)


def test_on_step35_flash_the_rule_gives_v4_flash():
    step35 = load_config(CONFIGS / "step35_flash.yaml", ["layout=F+SSSC*11"])
    defaults = SharedKVAttentionConfig()
    assert sizes(step35) == {name: getattr(defaults, name) for name in SIZES}
    assert (defaults.num_heads, defaults.head_dim, defaults.index_heads,
            defaults.index_head_dim) == (64, 512, 64, 128)  # DeepseekV4Config's


def test_given_sizes_win_and_the_rest_follow_them():
    config = load_config(TINY, ["layout=F+SSSH*2", "shared_kv_attention.num_heads=12",
                                "shared_kv_attention.head_dim=8"])
    assert sizes(config) == {"num_heads": 12, "head_dim": 8, "rope_dims": 8, "q_lora_rank": 32,
                             "o_groups": 4, "o_lora_rank": 32, "index_heads": 12,
                             "index_head_dim": 32}


def test_a_bad_given_size_is_still_named():
    with pytest.raises(ValueError, match=r"shared_kv_attention.num_heads: must be an integer "
                                         r">= 1, got 'four'"):
        load_config(TINY, ["layout=F+SSSC*2", "shared_kv_attention.num_heads=four"])


@pytest.mark.parametrize("preset", ["tiny_deepseek_v4.yaml", "deepseek_v4_flash.yaml",
                                    "gpu_1b_deepseek_v4.yaml"])
def test_v4_presets_keep_their_own_sizes(preset):
    values = yaml.safe_load((CONFIGS / preset).read_text())
    given = (values.get("model") or values)["shared_kv_attention"]
    assert set(SIZES) <= set(given)
    assert sizes(load_config(CONFIGS / preset)) == {name: given[name] for name in SIZES}


def test_models_without_shared_kv_layers_keep_the_defaults():
    # What the checkpoints of Step 3.5 and MiMo runs store, so they still resume.
    for preset in ("tiny.yaml", "tiny_mimo.yaml", "step35_flash.yaml"):
        assert load_config(CONFIGS / preset).shared_kv_attention == SharedKVAttentionConfig()


def test_the_derived_sizes_are_stored_and_read_back():
    mixed = load_config(TINY, ["layout=F+SSSC*2"])
    assert config_from_dict(config_to_dict(mixed)) == mixed
