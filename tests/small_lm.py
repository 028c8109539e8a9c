"""The small `CausalLM` shared by tests/model/test_model_variants.py and test_model_heads.py:
its config (5 layers `F+SSSF`, 1 dense layer, 2 MTP heads), random variables with every norm
weight and router bias non-zero, the baseline loss/outputs/gradients computed once per process
(`baseline()`), a scan<->per-layer converter written here from the layer plan (independent of
model/layers/params.py) and the comparison helpers. Compilation dominates on CPU: the test files
using it share one xdist group, so one worker builds the baseline once."""

from __future__ import annotations

import functools
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import CausalLM, load_config
from model.layers.layer_plan import layer_kinds, plan_segments

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
# LLVM optimisation level 0 roughly halves XLA:CPU compile time (the dominant cost here); the
# HLO, and so what is computed, is the same (no fast-math either way).
FAST = {"xla_backend_optimization_level": 0}

BATCH, LENGTH, VOCAB, D_MODEL, MTP_HEADS = 2, 16, 256, 64, 2
SMALL = [
    "num_layers=5", "layout=F+SSSF", "num_dense_layers=1", f"d_model={D_MODEL}",
    f"vocab_size={VOCAB}", f"mtp.num_heads={MTP_HEADS}", "window=4", "head_dim=16",
    "dense_hidden=96", "moe.expert_hidden=32", "moe.shared_hidden=32",
    # clamps on the last layer only, as in tiny.yaml / the released model (own scan segment)
    "swiglu_limits=[0, 0, 0, 0, 7.0]", "swiglu_limits_shared=[0, 0, 0, 0, 16.0]",
]
NUM_MOE_LAYERS = 4


def small_cfg(*overrides):
    return load_config(TINY, overrides=[*SMALL, *overrides])


def fast_jit(fn, **kwargs):
    return jax.jit(fn, compiler_options=FAST, **kwargs)


# ---- scan <-> per-layer converter (independent of model/layers/params.py) -----------------------


def unscan(tree: dict, cfg) -> dict:
    """layers/segment_{s}/block_{j} stacked over repeats -> layers/layer_{i}."""
    out = {}
    for s, seg in enumerate(plan_segments(layer_kinds(cfg))):
        blocks = tree.get(f"segment_{s}", {})
        for r in range(seg.repeats):
            for j in range(seg.period):
                if f"block_{j}" in blocks:
                    out[f"layer_{seg.start + r * seg.period + j}"] = jax.tree.map(
                        lambda a, r=r: a[r], blocks[f"block_{j}"])
    return out


def rescan(tree: dict, cfg) -> dict:
    out = {}
    for s, seg in enumerate(plan_segments(layer_kinds(cfg))):
        blocks = {}
        for j in range(seg.period):
            names = [f"layer_{seg.start + r * seg.period + j}" for r in range(seg.repeats)]
            if names[0] in tree:
                blocks[f"block_{j}"] = jax.tree.map(lambda *a: np.stack(a), *[tree[n] for n in names])
        if blocks:
            out[f"segment_{s}"] = blocks
    return out


def with_layers(collection: dict, layers: dict) -> dict:
    return {**collection, "layers": layers}


# ---- comparison helpers -------------------------------------------------------------------------


def assert_tree_close(got, want, rtol=1e-4, atol_rel=1e-5, what=""):
    """Leafwise allclose; atol is relative to each leaf's largest magnitude."""
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
    assert got_def == want_def, f"{what}: tree structures differ"
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, (what, jax.tree_util.keystr(path))
        scale = float(np.max(np.abs(w))) if w.size else 0.0
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol_rel * scale + 1e-12,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


def comparable(out) -> dict:
    """The outputs that must agree between equivalent variants."""
    return {"logits": out.logits, "mtp_logits": out.mtp_logits, "hidden": out.hidden,
            "mtp_hidden": out.mtp_hidden, "aux": out.aux}


# ---- the shared baseline -------------------------------------------------------------------------


def cross_entropy(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


@functools.lru_cache(maxsize=None)
def grad_runner(cfg):
    """jit(value_and_grad) of a training-like loss; returns ((loss, LMOutput), grads)."""
    lm = CausalLM(cfg)

    def loss_fn(params, balance, tokens, targets):
        out = lm.apply({"params": params, "balance": balance}, tokens)
        loss = cross_entropy(out.logits, targets[0])
        for h, mtp_logits in enumerate(out.mtp_logits, start=1):
            loss = loss + 0.3 * cross_entropy(mtp_logits, targets[h])
        return loss + 0.01 * out.aux["balance_loss"], out

    return fast_jit(jax.value_and_grad(loss_fn, has_aux=True))


def random_variables(cfg, tokens, seed=0):
    """Variables with the model's tree structure (from eval_shape of init) and random values:
    every norm weight and router bias non-zero so that misplaced parameters are detectable."""
    shapes = nn.unbox(jax.eval_shape(CausalLM(cfg).init, jax.random.PRNGKey(0), tokens))
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = jax.tree_util.keystr(path)
        if "router_bias" in name:
            values = rng.normal(scale=0.05, size=leaf.shape)
        elif "'router'" in name:
            # Larger router logits give clear top-k margins: with these values the smallest gap
            # between the k-th and (k+1)-th selection score is ~3e-5, far above the ~1e-7 float32
            # noise between equivalent variants, so no expert choice flips between them.
            values = rng.normal(scale=0.3, size=leaf.shape)
        elif leaf.ndim == 1 or "norm" in name or "'sink'" in name:
            values = rng.normal(scale=0.1, size=leaf.shape)
        else:
            values = rng.normal(scale=0.05, size=leaf.shape)
        return jnp.asarray(values, leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


class Baseline:
    def __init__(self):
        self.cfg = small_cfg()
        rng = np.random.default_rng(1)
        self.tokens = jnp.asarray(rng.integers(0, VOCAB, size=(BATCH, LENGTH)), jnp.int32)
        self.targets = jnp.asarray(rng.integers(0, VOCAB, size=(1 + MTP_HEADS, BATCH, LENGTH)),
                                   jnp.int32)
        variables = random_variables(self.cfg, self.tokens)
        self.params, self.balance = variables["params"], variables["balance"]
        (self.loss, self.out), self.grads = self.run(self.cfg)

    def run(self, cfg, params=None, balance=None, tokens=None):
        return grad_runner(cfg)(self.params if params is None else params,
                                self.balance if balance is None else balance,
                                self.tokens if tokens is None else tokens, self.targets)


@functools.lru_cache(maxsize=1)
def baseline() -> Baseline:
    """One baseline per process, whichever test file asks first."""
    return Baseline()
