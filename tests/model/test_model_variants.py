"""Whole-model tests of `model.CausalLM` on the small config of tests/small_lm.py: output shapes
and aux, the scanned parameter tree, and every variant that keeps the parameter shapes (scan off,
implementation switches, remat policies, bfloat16) run on the *same* parameters and compared with
the baseline. References are independent: a scan<->per-layer converter written from the layer
plan (tests/small_lm.py).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small_lm import (
    BATCH,
    D_MODEL,
    LENGTH,
    MTP_HEADS,
    NUM_MOE_LAYERS,
    VOCAB,
    assert_tree_close,
    comparable,
    fast_jit,
    rescan,
    small_cfg,
    unscan,
    with_layers,
)

from model import CausalLM
from model.layers.layer_plan import Segment, layer_kinds, plan_segments
from model.layers.stack import scan_unroll




# ---- outputs ------------------------------------------------------------------------------------


def test_output_shapes_and_aux(base):
    out, cfg = base.out, base.cfg
    assert out.logits.shape == (BATCH, LENGTH, VOCAB) and out.logits.dtype == jnp.float32
    assert len(out.mtp_logits) == MTP_HEADS
    for m in out.mtp_logits:
        assert m.shape == (BATCH, LENGTH, VOCAB) and m.dtype == jnp.float32
    assert out.hidden.shape == (BATCH, LENGTH, D_MODEL)
    assert len(out.mtp_hidden) == MTP_HEADS
    assert np.isfinite(float(base.loss))
    for leaf in jax.tree.leaves((out.logits, out.mtp_logits, base.grads)):
        assert np.all(np.isfinite(np.asarray(leaf)))

    aux = out.aux
    assert set(aux) == {"moe", "balance_loss", "sequence_balance_loss", "attention_gate_mean"}
    moe = aux["moe"]
    experts = cfg.moe.num_experts
    assert set(moe) == {"expert_load", "expert_prob", "balance_loss", "routing_confidence",
                        "expert_tokens", "expert_act_rms", "expert_out_norm_mean",
                        "expert_out_norm_max", "sequence_balance_loss", "routed_experts"}
    for key in moe:
        expected = {"balance_loss": (NUM_MOE_LAYERS,), "sequence_balance_loss": (NUM_MOE_LAYERS,),
                    "routing_confidence": (NUM_MOE_LAYERS, BATCH, LENGTH),
                    "routed_experts": (NUM_MOE_LAYERS, BATCH, LENGTH, cfg.moe.top_k)}.get(
                        key, (NUM_MOE_LAYERS, experts))
        assert moe[key].shape == expected, key
    assert aux["balance_loss"].shape == ()
    # summed over the MoE layers (none hash-routed here), as DeepSeek's per-layer aux loss
    np.testing.assert_allclose(float(aux["balance_loss"]), np.sum(np.asarray(moe["balance_loss"])),
                               rtol=1e-6)
    # dropless: every token's top_k copies are computed in every MoE layer
    tokens_per_layer = np.asarray(moe["expert_tokens"]).sum(-1)
    np.testing.assert_array_equal(tokens_per_layer, BATCH * LENGTH * cfg.moe.top_k)
    np.testing.assert_allclose(np.asarray(moe["expert_load"]),
                               np.asarray(moe["expert_tokens"]) / (BATCH * LENGTH * cfg.moe.top_k),
                               rtol=1e-6)
    # eq. 1 recomputed from the reported f_e, p_e with explicit loops over the EP groups
    groups, size = cfg.moe.num_ep_groups, experts // cfg.moe.num_ep_groups
    for layer in range(NUM_MOE_LAYERS):
        f, p = np.asarray(moe["expert_load"][layer]), np.asarray(moe["expert_prob"][layer])
        expected = groups * sum(f[g * size:(g + 1) * size].sum() * p[g * size:(g + 1) * size].sum()
                                for g in range(groups))
        np.testing.assert_allclose(float(moe["balance_loss"][layer]), expected, rtol=1e-5)
        np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-5)
    conf = np.asarray(moe["routing_confidence"])
    assert np.all((conf > 0) & (conf <= 1 + 1e-6))

    gates = aux["attention_gate_mean"]
    assert len(gates) == cfg.num_layers
    for i, gate in enumerate(gates):
        heads = cfg.attention_config(cfg.layout[i]).num_heads
        assert gate.shape == (heads,)
        assert np.all((np.asarray(gate) > 0) & (np.asarray(gate) < 1))


def test_scanned_param_tree_follows_the_layer_plan(base):
    cfg, layers = base.cfg, base.params["layers"]
    segments = plan_segments(layer_kinds(cfg))
    assert segments == [Segment(0, 1, 1), Segment(1, 1, 3), Segment(4, 1, 1)]
    assert set(layers) == {f"segment_{s}" for s in range(len(segments))}
    for s, seg in enumerate(segments):
        assert set(layers[f"segment_{s}"]) == {f"block_{j}" for j in range(seg.period)}
        for leaf in jax.tree.leaves(layers[f"segment_{s}"]):
            assert leaf.shape[0] == seg.repeats
    per_layer = unscan(layers, cfg)
    assert sorted(per_layer, key=lambda n: int(n.split("_")[1])) == [f"layer_{i}" for i in range(5)]
    for i in range(cfg.num_layers):
        assert ("moe" in per_layer[f"layer_{i}"]) == (i >= 1)
        assert ("mlp" in per_layer[f"layer_{i}"]) == (i < 1)
        heads = cfg.attention_config(cfg.layout[i]).num_heads
        assert per_layer[f"layer_{i}"]["self_attn"]["q_proj"]["kernel"].shape == (D_MODEL, heads, 16)
    # the unrolled model's own tree has exactly this structure
    unrolled = nn.unbox(jax.eval_shape(CausalLM(cfg.replace(scan_layers=False)).init,
                                       jax.random.PRNGKey(0), base.tokens))
    assert (jax.tree.structure(unrolled["params"]["layers"]) == jax.tree.structure(per_layer))
    assert jax.tree.map(np.shape, unrolled["params"]["layers"]) == jax.tree.map(np.shape, per_layer)
    assert (jax.tree.map(np.shape, unrolled["balance"]["layers"])
            == jax.tree.map(np.shape, unscan(base.balance["layers"], cfg)))
    # round trip
    assert_tree_close(rescan(per_layer, cfg), layers, rtol=0, atol_rel=0, what="rescan")


def test_repository_converter_agrees_with_the_test_converter(base):
    from model.layers.params import convert_layer_layout

    cfg = base.cfg
    variables = {"params": base.params, "balance": base.balance}
    unrolled = convert_layer_layout(variables, cfg, to_scan=False)
    assert_tree_close(unrolled["params"]["layers"], unscan(base.params["layers"], cfg), 0, 0)
    assert_tree_close(unrolled["balance"]["layers"], unscan(base.balance["layers"], cfg), 0, 0)
    back = convert_layer_layout(unrolled, cfg, to_scan=True)
    assert_tree_close(back, variables, 0, 0, what="round trip")


@pytest.mark.slow
def test_scan_on_and_off_agree(base):
    # The baseline scans both ways: its SSS segment fully unrolled, the rest as loops of one trip.
    unrolls = [scan_unroll(seg) for seg in plan_segments(layer_kinds(base.cfg))]
    assert 3 in unrolls and 1 in unrolls, unrolls
    cfg_off = base.cfg.replace(scan_layers=False)
    params = with_layers(base.params, unscan(base.params["layers"], base.cfg))
    balance = with_layers(base.balance, unscan(base.balance["layers"], base.cfg))
    (loss, out), grads = base.run(cfg_off, params, balance)
    # Same maths, different XLA fusion: float32 reassociation only (~1e-6 relative).
    np.testing.assert_allclose(float(loss), float(base.loss), rtol=1e-5)
    assert_tree_close(comparable(out), comparable(base.out), what="outputs")
    expected_grads = with_layers(base.grads, unscan(base.grads["layers"], base.cfg))
    assert_tree_close(grads, expected_grads, what="grads")


@pytest.mark.slow
@pytest.mark.parametrize("switch", ["attention_impl=cudnn", "moe_impl=ragged_dot"])
def test_implementation_switches_agree(base, switch):
    cfg = small_cfg(switch)
    (loss, out), grads = base.run(cfg)
    # Different kernels for the same maths: float32 rounding differences only.
    np.testing.assert_allclose(float(loss), float(base.loss), rtol=1e-5)
    assert_tree_close(comparable(out), comparable(base.out), what=f"{switch} outputs")
    assert_tree_close(grads, base.grads, what=f"{switch} grads")


@pytest.mark.parametrize("policy", ["full", "dots", "dots_with_kernels", "save_attention_out",
                                    "save_ffn_out"])
@pytest.mark.slow
def test_remat_policies_give_the_same_loss_and_gradients(base, policy):
    cfg = small_cfg(f"remat_policy={policy}")
    (loss, out), grads = base.run(cfg)
    # Rematerialisation recomputes the same ops; only XLA's fusion of the recomputed forward may
    # differ, so allow float32 reassociation noise and nothing more.
    np.testing.assert_allclose(float(loss), float(base.loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(base.out.logits), rtol=1e-5,
                               atol=1e-6)
    assert_tree_close(grads, base.grads, rtol=1e-5, atol_rel=1e-6, what=f"remat={policy} grads")


@pytest.mark.slow
def test_bfloat16_compute_is_close_to_float32(base):
    cfg = small_cfg("compute_dtype=bfloat16")
    lm = CausalLM(cfg)
    out = fast_jit(lm.apply)({"params": base.params, "balance": base.balance}, base.tokens)
    assert out.logits.dtype == jnp.float32  # logits always float32
    assert out.hidden.dtype == jnp.bfloat16
    for m in out.mtp_logits:
        assert m.dtype == jnp.float32
    got, want = np.asarray(out.logits, np.float64), np.asarray(base.out.logits, np.float64)
    assert np.all(np.isfinite(got))
    # Loose on purpose. bfloat16 keeps 8 mantissa bits (~0.4% per rounding), compounded over
    # 5 blocks (+2 MTP blocks): ~1% per token. On top, a near-tie in a top-k choice can flip one
    # expert for a few tokens (seen: 1 of 128 copies in 3 of 4 MoE layers), which moves those
    # tokens' logits by ~10-20% and leaks a little to later positions. So: the typical token must
    # be within bf16 precision, the whole tensor within 15%. A real dtype bug (params cast
    # wrongly, a norm or softmax in bf16 overflowing) gives O(1) errors on every token.
    per_token = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert np.median(per_token) < 0.03, per_token
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.15
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.99
    for g, w in zip(out.mtp_logits, base.out.mtp_logits):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        per_token = np.linalg.norm(g - w, axis=-1) / np.linalg.norm(w, axis=-1)
        assert np.median(per_token) < 0.03, per_token
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 0.15
