"""Whole-model tests of `model.CausalLM` on the small config of tests/small_lm.py: causality of
the main and MTP logits by perturbation, the MTP offsets, logits on demand, numpy projections for
tied / shared output heads, and variants that change the parameter tree (real init).
"""

from __future__ import annotations

import functools

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
    VOCAB,
    assert_tree_close,
    fast_jit,
    small_cfg,
    unscan,
)

from model import CausalLM
from model.config import MTPConfig




# ---- causality and MTP offsets ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("position", [0, 5, 9, 15])
def test_causality_of_main_and_mtp_logits(base, position):
    """Changing token p must not change main logits at t < p, nor MTP-h logits at t < p - h
    (MTP-h at t reads tokens up to t + h); it must change main logits at p and MTP-h at p - h."""
    tokens = base.tokens.at[:, position].set((base.tokens[:, position] + 7) % VOCAB)
    (_, out), _ = base.run(base.cfg, tokens=tokens)
    # Positions that cannot see the change are computed by the same ops on the same inputs:
    # only an atol far below any real leak (~1e-2 here) is allowed.
    diff = np.abs(np.asarray(out.logits) - np.asarray(base.out.logits)).max(axis=(0, 2))
    assert np.all(diff[:position] < 1e-6), diff
    assert diff[position] > 1e-3, diff
    for h, (new, old) in enumerate(zip(out.mtp_logits, base.out.mtp_logits), start=1):
        diff = np.abs(np.asarray(new) - np.asarray(old)).max(axis=(0, 2))
        first = max(position - h, 0)
        assert np.all(diff[:first] < 1e-6), (h, diff)
        if position - h >= 0:  # MTP-h at t = p - h reads the embedding of token t + h = p
            assert diff[position - h] > 1e-3, (h, diff)


def test_mtp_head_reads_token_t_plus_h_embedding(base):
    """Changing only the last token T-1 changes MTP-h exactly at t >= T-1-h (and main at T-1)."""
    last = LENGTH - 1
    tokens = base.tokens.at[:, last].set((base.tokens[:, last] + 1) % VOCAB)
    (_, out), _ = base.run(base.cfg, tokens=tokens)
    for h, (new, old) in enumerate(zip(out.mtp_logits, base.out.mtp_logits), start=1):
        diff = np.abs(np.asarray(new) - np.asarray(old)).max(axis=(0, 2))
        changed = set(np.nonzero(diff > 1e-6)[0].tolist())
        assert changed == set(range(last - h, LENGTH)), (h, sorted(changed))


# ---- logits on demand -----------------------------------------------------------------------------


@pytest.mark.slow
def test_compute_logits_false_and_project(base):
    lm = CausalLM(base.cfg)
    variables = {"params": base.params, "balance": base.balance}
    out = fast_jit(functools.partial(lm.apply, compute_logits=False))(variables, base.tokens)
    assert out.logits is None and out.mtp_logits == ()
    assert_tree_close(out.hidden, base.out.hidden, what="hidden")
    assert_tree_close(out.mtp_hidden, base.out.mtp_hidden, what="mtp_hidden")
    for head in range(MTP_HEADS + 1):
        project = fast_jit(functools.partial(lm.apply, method=CausalLM.project, head=head))
        hidden = out.hidden if head == 0 else out.mtp_hidden[head - 1]
        want = base.out.logits if head == 0 else base.out.mtp_logits[head - 1]
        got = project(variables, hidden)
        assert got.dtype == jnp.float32
        assert_tree_close(got, want, what=f"project head={head}")
        # and each head is a plain matmul with its own kernel (numpy reference)
        kernel = (base.params["lm_head"]["kernel"] if head == 0
                  else base.params[f"mtp_{head - 1}"]["output_head"]["kernel"])
        np.testing.assert_allclose(np.asarray(got), np.asarray(hidden, np.float64) @ np.asarray(kernel),
                                   rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("tie, share", [(True, False), (False, True)])
def test_tied_and_shared_output_heads_project_correctly(base, tie, share):
    cfg = base.cfg.replace(tie_embeddings=tie, mtp=MTPConfig(num_heads=MTP_HEADS, share_output_head=share))
    lm = CausalLM(cfg)
    shapes = nn.unbox(jax.eval_shape(lm.init, jax.random.PRNGKey(0), base.tokens))["params"]
    assert ("lm_head" in shapes) == (not tie)
    for i in range(MTP_HEADS):
        assert ("output_head" in shapes[f"mtp_{i}"]) == (not share)
    # the base params minus the heads that no longer exist fit the new tree exactly
    params = {k: v for k, v in base.params.items() if not (tie and k == "lm_head")}
    if share:
        params = {k: ({n: p for n, p in v.items() if n != "output_head"} if k.startswith("mtp_") else v)
                  for k, v in params.items()}
    assert jax.tree.structure(params) == jax.tree.structure(shapes)
    variables = {"params": params, "balance": base.balance}
    hidden = np.random.default_rng(3).normal(size=(BATCH, LENGTH, D_MODEL)).astype(np.float32)
    main_kernel = (np.asarray(params["embed_tokens"]["embedding"], np.float64).T if tie
                   else np.asarray(params["lm_head"]["kernel"], np.float64))
    for head in range(MTP_HEADS + 1):
        got = fast_jit(functools.partial(lm.apply, method=CausalLM.project, head=head))(variables, hidden)
        if head == 0 or share:
            kernel = main_kernel
        else:
            kernel = np.asarray(params[f"mtp_{head - 1}"]["output_head"]["kernel"], np.float64)
        np.testing.assert_allclose(np.asarray(got), hidden.astype(np.float64) @ kernel, rtol=1e-4,
                                   atol=1e-6, err_msg=f"head {head}")


# ---- variants that change the parameter tree: real init -----------------------------------------


def _init_with_output(cfg, tokens):
    lm = CausalLM(cfg)
    out, variables = fast_jit(lm.init_with_output)(jax.random.PRNGKey(2), tokens)
    return out, nn.unbox(variables)


@pytest.mark.slow
def test_sink_gate_tied_embeddings_and_shared_mtp_head(base):
    cfg = small_cfg("gate=sink", "tie_embeddings=true", "mtp.share_output_head=true")
    out, variables = _init_with_output(cfg, base.tokens)
    params = variables["params"]
    assert "lm_head" not in params
    for i in range(MTP_HEADS):
        assert "output_head" not in params[f"mtp_{i}"]
        assert "sink" in params[f"mtp_{i}"]["block"]["self_attn"]
    for name, layer in unscan(params["layers"], cfg).items():
        assert "sink" in layer["self_attn"] and "g_proj" not in layer["self_attn"], name
    assert "attention_gate_mean" not in out.aux and "moe" in out.aux
    embedding = np.asarray(params["embed_tokens"]["embedding"], np.float64)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(out.hidden, np.float64) @ embedding.T,
                               rtol=1e-4, atol=1e-6)
    for h in range(MTP_HEADS):
        np.testing.assert_allclose(np.asarray(out.mtp_logits[h]),
                                   np.asarray(out.mtp_hidden[h], np.float64) @ embedding.T,
                                   rtol=1e-4, atol=1e-6)
    assert np.all(np.isfinite(np.asarray(out.logits)))


@pytest.mark.slow
def test_no_gate_and_explicit_moe_layers(base):
    cfg = small_cfg("gate=none", "moe_layers=[0, 3]")
    out, variables = _init_with_output(cfg, base.tokens)
    per_layer = unscan(variables["params"]["layers"], cfg)
    assert sorted(per_layer) == [f"layer_{i}" for i in range(5)]
    for i in range(5):
        layer = per_layer[f"layer_{i}"]
        assert ("moe" in layer) == (i in (0, 3)), i
        assert ("mlp" in layer) == (i not in (0, 3)), i
        assert "g_proj" not in layer["self_attn"] and "sink" not in layer["self_attn"]
    balance = unscan(variables["balance"]["layers"], cfg)
    assert sorted(balance) == ["layer_0", "layer_3"]
    assert set(out.aux) == {"moe", "balance_loss", "sequence_balance_loss"}
    assert out.aux["moe"]["expert_tokens"].shape == (2, cfg.moe.num_experts)
    np.testing.assert_array_equal(np.asarray(out.aux["moe"]["expert_tokens"]).sum(-1),
                                  BATCH * LENGTH * cfg.moe.top_k)
    assert out.logits.shape == (BATCH, LENGTH, VOCAB)
    assert np.all(np.isfinite(np.asarray(out.logits)))
