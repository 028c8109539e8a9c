"""Parity of the MiMo-V2-Flash checkpoint family (`model.interop.mimo_v2_flash`) with
transformers' `MiMoV2FlashForCausalLM` (eager attention): a tiny random transformers model saved
with `save_pretrained` imports into stepjax with the same logits, and a random stepjax model
exported with `save_hf_checkpoint` loads with `from_pretrained` to our logits.

Every parameter or buffer transformers initialises to a constant (norm weights, router biases)
is drawn at random first and the sinks are drawn wider than their N(0, 0.02^2) init, so no
mapping hides behind a zero, a one or a near-zero. Sequences of 32 tokens with a window of 8
make the sliding window and the sinks matter; schedules cover transformers' default layer
pattern and dense-first FFNs, custom `layer_types` / `mlp_layer_types` (MoE layers not a
suffix), and group-limited routing (2 of 4 groups, 1 of 2).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import config_from_dict
from model.interop.hf import load_hf_checkpoint, save_hf_checkpoint
from model.lm import CausalLM, abstract_variables

VOCAB, D, LENGTH, WINDOW, RTOL = 96, 32, 32, 8, 1e-5
HF_LAYER_TYPES = {"F": "full_attention", "S": "sliding_attention"}


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def tokens(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (2, LENGTH)).astype(np.int64)


def our_logits(config, variables, ids: np.ndarray) -> np.ndarray:
    forward = jax.jit(lambda v, x: CausalLM(config).apply(v, x).logits)
    return np.asarray(forward(variables, jnp.asarray(ids, jnp.int32)))


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


# ---- transformers -> stepjax -------------------------------------------------------------------


def hf_model(num_layers: int, layout: str | None, moe: str | None, groups: tuple[int, int],
             seed: int):
    """A tiny float32 MiMoV2FlashForCausalLM (8 experts, top 2 of `groups` = (n_group,
    topk_group)); `layout` / `moe` ('D' dense, 'M' MoE per layer) None: transformers' defaults.
    Norms around 1, router biases N(0, 0.3^2), sinks N(0, 1)."""
    import torch
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    torch.manual_seed(seed)
    lists = {}
    if layout is not None:
        lists["layer_types"] = [HF_LAYER_TYPES[kind] for kind in layout]
    if moe is not None:
        lists["mlp_layer_types"] = ["sparse" if kind == "M" else "dense" for kind in moe]
    config = MiMoV2FlashConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=48, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16,
        sliding_window=WINDOW, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, n_group=groups[0], topk_group=groups[1],
        routed_scaling_factor=2.0, attention_value_scale=0.707, initializer_range=0.1,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5e6,
                               "partial_rotary_factor": 0.334},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.5}},
        attn_implementation="eager", **lists)
    model = MiMoV2FlashForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    return model


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("num_layers, layout, moe, groups, want_layout, want_moe", [
    (7, None, None, (1, 1), "FSSSSFS", [1, 2, 3, 4, 5, 6]),  # transformers' defaults
    (5, "SFSSF", "MDMMD", (4, 2), "SFSSF", [0, 2, 3]),
    (4, "FSFS", "DMMM", (2, 1), "FSFS", [1, 2, 3]),
])
def test_a_saved_transformers_model_imports_with_its_logits(tmp_path, num_layers, layout, moe,
                                                             groups, want_layout, want_moe):
    model = hf_model(num_layers, layout, moe, groups, seed=num_layers)
    model.save_pretrained(tmp_path / "hf")
    config, variables = load_hf_checkpoint(tmp_path / "hf", progress=False)
    assert (config.layout, config.moe_layer_indices()) == (want_layout, want_moe)
    assert (config.moe.num_groups, config.moe.topk_groups) == groups
    ids = tokens(seed=num_layers + 1)
    want = torch_logits(model, ids)
    assert relative_error(our_logits(config, variables, ids), want) < RTOL


# ---- stepjax -> transformers -------------------------------------------------------------------


def our_model(layout: str, moe_layers: list[int], groups: tuple[int, int], tie: bool,
              seed: int):
    """A tiny stepjax MiMo-V2-Flash model with every leaf random: N(0, 0.1^2) weights,
    N(0, 0.2^2) for what stepjax initialises to zero (norm offsets, sinks, router biases)."""
    config = config_from_dict(dict(
        vocab_size=VOCAB, d_model=D, num_layers=len(layout), layout=layout, window=WINDOW,
        head_dim=24, num_kv_heads=1, v_head_dim=16, gate="none", qk_norm=False,
        value_scale=0.707,
        full_attention=dict(num_heads=4, rope_theta=5e6, partial_rotary_factor=0.334),
        swa_attention=dict(num_heads=4, num_kv_heads=2, rope_theta=1e4,
                           partial_rotary_factor=0.5, gate="sink"),
        num_dense_layers=0, moe_layers=moe_layers, dense_hidden=48,
        moe=dict(num_experts=8, top_k=2, expert_hidden=16, num_shared_experts=0,
                 routed_scaling_factor=2.0, num_groups=groups[0], topk_groups=groups[1],
                 num_ep_groups=1),
        mtp=dict(num_heads=0), tie_embeddings=tie))
    rng = np.random.default_rng(seed)
    abstract = nn.meta.unbox(abstract_variables(config))
    return config, jax.tree.map(
        lambda leaf: jnp.asarray((0.1 if leaf.ndim > 1 else 0.2) * rng.standard_normal(
            leaf.shape), leaf.dtype), abstract)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("layout, moe_layers, groups, tie", [
    ("FSSSSF", [1, 2, 3, 4, 5], (1, 1), False),
    ("SFSF", [0, 2, 3], (4, 2), True),
])
def test_an_exported_model_loads_into_transformers_with_our_logits(tmp_path, layout, moe_layers,
                                                                   groups, tie):
    from transformers import MiMoV2FlashForCausalLM

    config, variables = our_model(layout, moe_layers, groups, tie, seed=len(layout))
    save_hf_checkpoint(config, variables, tmp_path / "hf", progress=False)
    model, info = MiMoV2FlashForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True, attn_implementation="eager")
    assert not any(info.values()), info  # every tensor found, none left over
    ids = tokens(seed=7)
    want = our_logits(config, variables, ids)
    assert relative_error(torch_logits(model.float().eval(), ids), want) < RTOL
