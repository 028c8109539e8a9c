"""Tests of `train.optim.optimizer` and `train.optim.schedules`: parameter groups on the tiny
model's real logical axes, one optimizer step (update RMS, decoupled weight decay, frozen router)
and the learning-rate schedules with the report's numbers (3.1)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from model.config import load_config
from model.lm import abstract_variables
from model.parallel.rules import param_axes
from train.config import TrainConfig
from train.optim.config import MuonConfig
from train.optim.muon import ScaleByMuonState, matrix_view
from train.optim.optimizer import applied_updates, build_optimizer, param_labels
from train.optim.schedules import decay_start, learning_rate_schedule

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
TINY_MIMO = TINY.with_name("tiny_mimo.yaml")
is_axes = lambda x: isinstance(x, tuple)  # noqa: E731


def _boxed_shapes(overrides=(), path=TINY):
    cfg = load_config(path, list(overrides))
    return abstract_variables(cfg)


@pytest.fixture(scope="module")
def tiny_sink():
    """(axes tree, unboxed param shapes) of the tiny model with attention sinks."""
    boxed = _boxed_shapes(["gate=sink"])
    return param_axes(boxed), nn.meta.unbox(boxed)["params"]


@pytest.fixture(scope="module")
def tiny_headwise():
    boxed = _boxed_shapes()
    return param_axes(boxed), nn.meta.unbox(boxed)["params"]


@pytest.fixture(scope="module")
def tiny_mimo():
    """MiMo-V2-Flash's per-type geometry: sinks on SWA layers only, narrower values."""
    boxed = _boxed_shapes(path=TINY_MIMO)
    return param_axes(boxed), nn.meta.unbox(boxed)["params"]


def _by_path(tree, is_leaf=None):
    return {"/".join(str(k.key) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def _expected_label(path: str) -> str:
    """The report's split, written from parameter names (independent of the logical axes)."""
    name = path.split("/")[-1]
    owner = path.split("/")[-2]
    if name in ("embedding", "sink") or owner in ("lm_head", "output_head") or name == "weight":
        return "adamw"  # embeddings, output heads, RMSNorm weights, attention sinks
    return "muon"


@pytest.mark.parametrize("fixture", ["tiny_sink", "tiny_headwise", "tiny_mimo"])
def test_labels_on_the_tiny_model(fixture, request):
    axes, _ = request.getfixturevalue(fixture)
    labels = _by_path(param_labels(axes))
    assert labels == {path: _expected_label(path) for path in labels}
    kinds = {path.split("/")[-2] if path.endswith("kernel") else path.split("/")[-1]
             for path, label in labels.items() if label == "muon"}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
            "router", "eh_proj"} <= kinds
    assert ("g_proj" in kinds) == (fixture == "tiny_headwise")
    sinks = [path for path in labels if path.endswith("sink")]
    assert bool(sinks) == (fixture in ("tiny_sink", "tiny_mimo"))
    if fixture == "tiny_mimo":  # F+SSSSF scans as segments F, SSSS, F; the MTP block is S
        assert sinks == ["layers/segment_1/block_0/self_attn/sink", "mtp_0/block/self_attn/sink"]


def test_freeze_router_and_adamw_only_labels(tiny_sink):
    axes, _ = tiny_sink
    muon = _by_path(param_labels(axes))
    frozen = _by_path(param_labels(axes, freeze_router=True))
    routers = {p for p in muon if p.endswith("moe/router")}
    assert routers
    assert {p for p, label in frozen.items() if label == "frozen"} == routers
    assert all(frozen[p] == muon[p] for p in muon if p not in routers)
    adamw = _by_path(param_labels(axes, optimizer="adamw", freeze_router=True))
    assert all(label == ("frozen" if p in routers else "adamw") for p, label in adamw.items())


@pytest.mark.parametrize("trained", [0, 1, 3])
def test_mtp_heads_outside_the_loss_are_frozen(tiny_sink, trained):
    axes, _ = tiny_sink
    every = _by_path(param_labels(axes))
    labels = _by_path(param_labels(axes, trained_mtp_heads=trained))
    for path, label in labels.items():
        head = int(path.split("/")[0].removeprefix("mtp_")) if path.startswith("mtp_") else None
        assert label == ("frozen" if head is not None and head >= trained else every[path]), path


def test_matrix_views_of_the_tiny_model(tiny_sink):
    axes, shapes = tiny_sink
    cfg = load_config(TINY)
    d, hd, e, f = cfg.d_model, cfg.head_dim, cfg.moe.num_experts, cfg.moe.expert_hidden
    views = {p: dataclasses.astuple(matrix_view(a, s.shape)) for (p, a), s in zip(
        _by_path(axes, is_axes).items(), jax.tree.leaves(shapes))}
    seg = "layers/segment_1/block_0"  # scanned MoE layers with SWA
    layers = shapes["layers"]["segment_1"]["block_0"]["input_layernorm"]["weight"].shape[0]
    heads = cfg.swa_attention.num_heads
    assert views[f"{seg}/self_attn/q_proj/kernel"] == ((layers,), d, heads * hd)
    assert views[f"{seg}/self_attn/o_proj/kernel"] == ((layers,), heads * hd, d)
    assert views[f"{seg}/moe/gate_proj"] == ((layers, e), d, f)
    assert views[f"{seg}/moe/down_proj"] == ((layers, e), f, d)
    assert views[f"{seg}/moe/router"] == ((layers,), d, e)
    assert views["mtp_0/eh_proj/kernel"] == ((), 2 * d, d)
    assert views["mtp_0/block/self_attn/k_proj/kernel"] == ((), d, cfg.num_kv_heads * hd)


# DeepSeek-V4 params as the model names them, hand-made (scanned over 3 layers where marked).
V4_AXES = {
    "o_a_proj": ("layers", "o_groups", "o_group_in", "o_lora"),  # grouped output projection
    "position_bias": ("layers", "compress_slot", "kv_lora"),  # KV compressor, per slot
    "fn": ("layers", "hc_streams", "embed", "hc_mix"), "base": ("layers", "hc_mix"),  # mHC
    "scale": ("layers", "hc_gate"),
    "hc_fn": ("hc_streams", "embed", "hc_mix"), "hc_base": ("hc_mix",), "hc_scale": ("hc_gate",),
    "sink": ("layers", "heads"),
}
V4_SHAPES = {"o_a_proj": (3, 2, 8, 4), "position_bias": (3, 4, 6), "fn": (3, 2, 4, 8),
             "base": (3, 8), "scale": (3, 3), "hc_fn": (2, 4, 2), "hc_base": (2,),
             "hc_scale": (1,), "sink": (3, 4)}


def test_labels_of_the_deepseek_v4_params():
    """Report 2.4: AdamW for mHC's biases and gates (and the sinks, the compressor's position
    biases); Muon for the rest: mHC's fn kernels and the grouped output projection."""
    labels = param_labels(V4_AXES)
    assert {p for p, label in labels.items() if label == "muon"} == {"o_a_proj", "fn", "hc_fn"}


def test_deepseek_v4_params_step():
    """One step: each output-projection group and each layer's [n*D, width] mHC kernel gets its
    own orthogonal update; the position bias is AdamW's and not decayed (zero gradient: no
    change)."""
    rng = np.random.default_rng(4)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in V4_SHAPES.items()}
    grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in V4_SHAPES.items()}
    grads["position_bias"] = np.zeros(V4_SHAPES["position_bias"], np.float32)
    lr, wd, rms = 0.5, 0.1, 0.2
    tx = build_optimizer(V4_AXES, learning_rate=lr, weight_decay=wd, grad_clip=0.0,
                         muon=dict(update_rms=rms))
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    assert np.all(np.asarray(updates["position_bias"]) == 0)

    def singular_values(name, matrix_shape):
        direction = -np.asarray(updates[name]) / lr - wd * params[name]  # undo lr and decay
        blocks = direction.reshape(-1, *matrix_shape)
        return np.linalg.svd(blocks, compute_uv=False) / (rms * np.sqrt(max(matrix_shape)))

    np.testing.assert_allclose(singular_values("o_a_proj", (8, 4)), 1.0, atol=0.02)  # 6 groups
    np.testing.assert_allclose(singular_values("fn", (2 * 4, 8)), 1.0, atol=0.02)  # 3 layers


@pytest.fixture(scope="module")
def one_step(tiny_sink):
    """One update of the tiny model (gate=sink, router frozen): lr 0.5 constant, wd 0.1, no clip.
    Random gradients except for a few params that get zero gradients, to see the pure decay."""
    axes, shapes = tiny_sink
    cfg = TrainConfig(lr=0.5, warmup_steps=0, schedule="constant", weight_decay=0.1,
                      grad_clip=0.0, freeze_router=True, muon=MuonConfig(update_rms=0.2))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)
    zero_grad = {"embed_tokens/embedding", "norm/weight", "mtp_0/eh_proj/kernel",
                 "layers/segment_0/block_0/self_attn/sink"}
    grads = jax.tree.unflatten(jax.tree.structure(params), [
        np.zeros_like(p) if path in zero_grad else rng.standard_normal(p.shape).astype(np.float32)
        for path, p in _by_path(params).items()])
    tx = build_optimizer(axes, learning_rate=learning_rate_schedule(**cfg.schedule_settings()),
                         **cfg.optimizer_settings())
    state = tx.init(params)
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    labels = _by_path(param_labels(axes, optimizer=cfg.optimizer, freeze_router=True))
    return dict(cfg=cfg, params=_by_path(params), grads=_by_path(grads),
                updates=_by_path(updates), labels=labels,
                zero_grad=zero_grad, state=state, new_state=new_state)


@pytest.mark.slow
def test_muon_updates_have_the_configured_rms(one_step):
    cfg, p, u = one_step["cfg"], one_step["params"], one_step["updates"]
    checked = 0
    for path, label in one_step["labels"].items():
        if label != "muon" or path in one_step["zero_grad"]:
            continue
        direction = -np.asarray(u[path]) / cfg.lr - cfg.weight_decay * p[path]  # undo lr and wd
        rms = np.sqrt(np.mean(np.square(direction)))
        assert rms == pytest.approx(0.2, rel=1e-2), path  # measured: within 0.45%
        checked += 1
    assert checked > 50


def test_weight_decay_is_decoupled(one_step):
    cfg, p, u = one_step["cfg"], one_step["params"], one_step["updates"]
    shrink = -cfg.lr * cfg.weight_decay
    # Zero gradient: Muon (eh_proj) and AdamW (embedding) params only shrink by lr * wd * param.
    for path in ("embed_tokens/embedding", "mtp_0/eh_proj/kernel"):
        np.testing.assert_allclose(u[path], shrink * p[path], rtol=1e-5, atol=1e-7)
    # Norm weights and sinks are not decayed: no gradient, no change.
    for path in ("norm/weight", "layers/segment_0/block_0/self_attn/sink"):
        assert np.all(np.asarray(u[path]) == 0), path
    # With a gradient, AdamW's first step is -lr * g / (|g| + eps) for norms ...
    g = one_step["grads"]
    norm = "layers/segment_1/block_0/input_layernorm/weight"
    adam = lambda x: -cfg.lr * x / (np.abs(x) + cfg.adam_eps)  # noqa: E731
    np.testing.assert_allclose(u[norm], adam(g[norm]), rtol=1e-5)
    # ... plus the decay for the LM head.
    head = "lm_head/kernel"
    np.testing.assert_allclose(u[head], adam(g[head]) + shrink * p[head], rtol=1e-5, atol=1e-7)


def test_frozen_router_unchanged_others_change(one_step):
    u = one_step["updates"]
    routers = [p for p, label in one_step["labels"].items() if label == "frozen"]
    assert routers and all(p.endswith("moe/router") for p in routers)
    for path, update in u.items():
        if path in routers:
            assert np.all(np.asarray(update) == 0), path
        elif path not in one_step["zero_grad"]:
            assert np.abs(np.asarray(update)).max() > 0, path


def test_frozen_params_carry_no_optimizer_state(one_step):
    """Frozen params reach Muon and Adam as optax.MaskedNode: no momentum or moments, so no
    orthogonalisation either (scale_by_muon skips masked leaves)."""
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    states = [s for s in jax.tree.leaves(one_step["state"], is_leaf=lambda x: isinstance(
        x, (ScaleByMuonState, optax.ScaleByAdamState))) if hasattr(s, "_fields")]
    buffers = {"muon": [_by_path(s.momentum, masked) for s in states
                        if isinstance(s, ScaleByMuonState)],
               "adamw": [_by_path(s.mu, masked) for s in states
                         if isinstance(s, optax.ScaleByAdamState)]}
    assert [len(b) for b in buffers.values()] == [1, 1]
    for group, (tree,) in buffers.items():
        for path, label in one_step["labels"].items():
            assert masked(tree[path]) == (label != group), (group, path)


def test_logged_learning_rate_follows_applied_updates(one_step):
    lr = one_step["cfg"].lr
    schedule = learning_rate_schedule(lr=lr, warmup_steps=4, schedule="cosine", total_steps=10)
    assert float(schedule(applied_updates(one_step["state"]))) == 0.0
    assert float(schedule(applied_updates(one_step["new_state"]))) == pytest.approx(lr / 4)


def test_gradient_clipping_excludes_frozen_params():
    """The clipping norm covers the trained params only: a frozen router's huge gradient must
    not shrink the others (report 4.2: the router is not trained)."""
    axes = {"w": ("embed", "vocab"), "router": ("embed", "expert")}
    params = {"w": jnp.ones((4, 8)), "router": jnp.ones((4, 3))}
    grads = {"w": jnp.full((4, 8), 0.1), "router": jnp.full((4, 3), 100.0)}
    # b1 = b2 = 0, eps = 1: the Adam update g / (|g| + 1) shows the gradient's scale.
    for freeze, expected_w in ((True, 0.1 / 1.1), (False, None)):
        tx = build_optimizer(axes, learning_rate=1.0, optimizer="adamw", weight_decay=0.0,
                             grad_clip=1.0, adam_b1=0.0, adam_b2=0.0, adam_eps=1.0,
                             freeze_router=freeze)
        updates, _ = tx.update(grads, tx.init(params), params)
        if freeze:  # |g_w| = 0.1 * sqrt(32) < 1: not clipped
            np.testing.assert_allclose(updates["w"], -expected_w, rtol=1e-5)
            assert np.all(np.asarray(updates["router"]) == 0)
        else:  # global norm ~346: everything shrinks ~346-fold
            assert np.abs(np.asarray(updates["w"])).max() < 1e-3


# ---------------------------------------------------------------------------------------------
# Schedules (report 3.1)


def _at(schedule, steps):
    return np.array([float(schedule(jnp.asarray(s))) for s in steps])


def test_warmup_is_linear_from_zero():
    schedule = learning_rate_schedule(lr=1e-3, warmup_steps=100, schedule="cosine",
                                      total_steps=1000)
    np.testing.assert_allclose(_at(schedule, [0, 25, 50, 100]), [0, 2.5e-4, 5e-4, 1e-3],
                               rtol=1e-6)


def test_cosine_ends_at_min_lr():
    # the train: section's fields reach the schedule (TrainConfig.schedule_settings)
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=100, steps=1100)
    schedule = learning_rate_schedule(**cfg.schedule_settings())
    values = _at(schedule, [100, 600, 1100, 5000])
    np.testing.assert_allclose(values, [1e-3, 5.5e-4, 1e-4, 1e-4], rtol=1e-5)
    assert np.all(np.diff(_at(schedule, range(100, 1101, 50))) < 0)


def test_constant_and_no_warmup():
    assert _at(learning_rate_schedule(lr=2e-3, warmup_steps=0, schedule="constant"),
               [0, 10**6]).tolist() == pytest.approx([2e-3, 2e-3])
    cosine = learning_rate_schedule(lr=2e-3, min_lr=0.0, warmup_steps=0, schedule="cosine",
                                    total_steps=10)
    np.testing.assert_allclose(_at(cosine, [0, 5, 10]), [2e-3, 1e-3, 0.0], atol=1e-9)


def test_report_stages_are_continuous():
    """Report 3.1: warm-up to 2.5e-4 (2k steps), cosine to 5e-5, cosine to 2e-5, then constant
    2e-5 (stage lengths scaled down)."""
    schedule = learning_rate_schedule(lr=2.5e-4, warmup_steps=2000, schedule="stages",
                                      stages=((10000, 5e-5, "cosine"), (4000, 2e-5, "cosine"),
                                              (3000, 2e-5, "constant")))
    boundaries = {2000: 2.5e-4, 12000: 5e-5, 16000: 2e-5, 19000: 2e-5}
    for step, value in boundaries.items():
        np.testing.assert_allclose(_at(schedule, [step - 1, step, step + 1]), value, rtol=2e-3)
    np.testing.assert_allclose(_at(schedule, [7000, 14000, 17500, 10**6]),
                               [1.5e-4, 3.5e-5, 2e-5, 2e-5], rtol=1e-5)


def test_linear_and_constant_stage_shapes():
    """A constant stage holds its start value; the next starts from the stage's end_lr."""
    schedule = learning_rate_schedule(lr=1e-3, warmup_steps=10, schedule="stages",
                                      stages=((100, 5e-4, "constant"), (100, 1e-4, "linear")))
    values = _at(schedule, [10, 109, 110, 160, 210, 10**5])
    np.testing.assert_allclose(values, [1e-3, 1e-3, 5e-4, 3e-4, 1e-4, 1e-4], rtol=1e-5)


@pytest.mark.parametrize("settings, start", [
    (dict(schedule="cosine", warmup_steps=10, min_lr=1e-4), 10),
    (dict(schedule="cosine", warmup_steps=10, min_lr=1e-3), None),  # min_lr = lr: no decay
    (dict(schedule="constant", warmup_steps=10), None),
    # DeepSeek-V4's shape: warm-up, a long constant peak, a cosine decay at the end
    (dict(schedule="stages", warmup_steps=10,
          stages=((50, 1e-3, "constant"), (40, 1e-4, "cosine"))), 60),
    # a step drop: a constant stage whose lower end takes over after it
    (dict(schedule="stages", warmup_steps=0,
          stages=((30, 5e-4, "constant"), (20, 5e-4, "constant"))), 30),
])
def test_decay_start_is_where_the_rate_starts_to_fall(settings, start):
    """The MTP weight switches at `decay_start` (DeepSeek-V4 report 4.2.2): every rate after
    warm-up and before it is the peak, the one after it lower (a cosine starts falling after
    its first step, a step drop at it); no start where the rate never falls."""
    settings = dict(lr=1e-3, total_steps=100, **settings)
    assert decay_start(**settings) == start
    warmup = settings["warmup_steps"]
    below = np.flatnonzero(_at(learning_rate_schedule(**settings), range(warmup, 100))
                           < 1e-3 * (1 - 1e-6)) + warmup
    if start is None:
        assert below.size == 0
    else:
        assert below[0] in (start, start + 1) and start + 1 in below
