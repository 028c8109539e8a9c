"""train.telemetry.monitors against explicit numpy loops on small synthetic arrays (report
4.1.2-4.1.3, 5.2.1), and expert parameter norms in both layer layouts of a real
(shape-only) model tree."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import meta

from model import load_config
from model.layers.params import convert_layer_layout
from model.lm import abstract_variables
from train.telemetry.monitors import (
    expert_norm_table,
    expert_param_norms,
    moe_monitors,
    tree_rms,
)

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
L, E, B, T = 3, 6, 2, 5


def synthetic_aux(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 20, size=(L, E)).astype(np.float32)
    tokens[1, 2] = 0  # an expert that received no token: statistics are 0 there
    tokens[2, [0, 5]] = 0
    act = rng.uniform(0.5, 2.0, (L, E)).astype(np.float32)
    out_mean = rng.uniform(0.5, 2.0, (L, E)).astype(np.float32)
    out_max = out_mean * rng.uniform(1.0, 3.0, (L, E)).astype(np.float32)
    for arr in (act, out_mean, out_max):
        arr[tokens == 0] = 0.0
    act[0, 4] = 50.0  # a "rogue" expert (4.1.3)
    return {
        "expert_load": tokens / tokens.sum(-1, keepdims=True),
        "expert_tokens": tokens,
        "expert_act_rms": act,
        "expert_out_norm_mean": out_mean,
        "expert_out_norm_max": out_max,
        "routing_confidence": rng.uniform(0.2, 1.0, (L, B, T)).astype(np.float32),
        "balance_loss": rng.uniform(size=(L,)).astype(np.float32),
    }


def np_reference(aux, ids):
    """Loops over layers and experts in float64."""
    ref = {}
    per_layer = {}
    for r, i in enumerate(ids):
        load = [float(aux["expert_load"][r, e]) for e in range(E)]
        mean = sum(load) / E
        active = [e for e in range(E) if aux["expert_tokens"][r, e] > 0]
        stats = {"load_max_over_mean": max(load) / mean, "load_min_over_mean": min(load) / mean}
        for name, key in (("act_rms", "expert_act_rms"), ("out_norm", "expert_out_norm_mean")):
            vals = [float(aux[key][r, e]) for e in active]
            med = float(np.median(vals))
            stats[f"{name}_max_over_median"] = max(vals) / med
            stats[f"{name}_min_over_median"] = min(vals) / med
        stats["out_norm_peak"] = max(float(aux["expert_out_norm_max"][r, e]) for e in range(E))
        conf = aux["routing_confidence"][r]
        stats["routing_confidence"] = sum(float(conf[b, t]) for b in range(B)
                                          for t in range(T)) / (B * T)
        for name, value in stats.items():
            ref[f"moe/layer{i}/{name}"] = value
            per_layer.setdefault(name, []).append(value)
    for name, values in per_layer.items():
        if name == "routing_confidence":
            ref[f"moe/{name}"] = sum(values) / len(values)
        elif "_min_" in name:
            ref[f"moe/{name}"] = min(values)
        else:
            ref[f"moe/{name}"] = max(values)
    ref["moe/dead_experts"] = float(sum(aux["expert_tokens"][r, e] == 0
                                        for r in range(L) for e in range(E)))
    return ref


@pytest.mark.parametrize("ids", [None, [3, 5, 8]])
def test_moe_monitors_match_numpy_loops(ids):
    aux = synthetic_aux()
    got = jax.jit(lambda a: moe_monitors(a, ids))(aux)
    names = ids or list(range(L))
    ref = np_reference(aux, names)
    scalars = {k: v for k, v in got.items() if not k.startswith("moe_hist/")}
    assert set(scalars) == set(ref)
    for name, value in ref.items():
        np.testing.assert_allclose(float(scalars[name]), value, rtol=1e-5, err_msg=name)
        assert scalars[name].shape == ()
    # The idle expert does not drag min/median to 0: expert-side collapse stays visible.
    assert float(got[f"moe/layer{names[1]}/act_rms_min_over_median"]) > 0
    assert float(got["moe/act_rms_max_over_median"]) == pytest.approx(
        ref[f"moe/layer{names[0]}/act_rms_max_over_median"], rel=1e-5)
    for r, i in enumerate(names):
        for key in ("load", "act_rms", "out_norm_mean", "out_norm_max"):
            np.testing.assert_array_equal(got[f"moe_hist/layer{i}/{key}"],
                                          aux[f"expert_{key}"][r])


def test_moe_monitors_rejects_wrong_layer_ids():
    with pytest.raises(ValueError, match="layer_ids"):
        moe_monitors(synthetic_aux(), [1, 2])


def test_all_zero_statistics_give_finite_ratios():
    aux = synthetic_aux()
    aux["expert_out_norm_mean"] = np.zeros((L, E), np.float32)
    got = moe_monitors(aux)
    assert float(got["moe/out_norm_max_over_median"]) == 0.0


def test_tree_rms():
    tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": [jnp.full((4,), -2.0)]}
    flat = np.concatenate([np.arange(6.0), np.full(4, -2.0)])
    np.testing.assert_allclose(float(tree_rms(tree)), np.sqrt(np.mean(flat ** 2)), rtol=1e-6)
    assert float(tree_rms({})) == 0.0


def np_expert_norms(layer_params):
    """Per expert: sqrt of the summed squares of its gate, up and down matrices (loops)."""
    moe = layer_params["moe"]
    norms = []
    for e in range(moe["gate_proj"].shape[0]):
        total = 0.0
        for name in ("gate_proj", "up_proj", "down_proj"):
            total += float(np.sum(np.asarray(moe[name][e], np.float64) ** 2))
        norms.append(np.sqrt(total))
    return norms


@pytest.fixture(scope="module")
def model_params():
    """A scanned param tree whose MoE layers form a multi-block repeated segment (period 4), so
    the model-order of (repeat, block) is exercised; random values, shapes from eval_shape."""
    cfg = load_config(TINY, overrides=["swiglu_limits=[0,0,0,0,0,0,0,0,0]",
                                       "swiglu_limits_shared=[0,0,0,0,0,0,0,0,0]"])
    shapes = abstract_variables(cfg)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32),
                          meta.unbox(shapes)["params"])
    assert any(v["moe"]["gate_proj"].ndim == 4 and len(block) > 1
               for block in params["layers"].values() for v in block.values() if "moe" in v)
    return cfg, params


def test_expert_param_norms_match_per_layer_loops(model_params):
    cfg, params = model_params
    per_layer = convert_layer_layout({"params": params}, cfg, to_scan=False)["params"]["layers"]
    ids = cfg.moe_layer_indices()
    assert ids == [i for i in range(cfg.num_layers) if f"layer_{i}" in per_layer
                   and "moe" in per_layer[f"layer_{i}"]]
    ref = np.array([np_expert_norms(per_layer[f"layer_{i}"]) for i in ids])
    np.testing.assert_allclose(expert_norm_table(params, cfg), ref, rtol=1e-5)
    unscanned = cfg.replace(scan_layers=False)
    np.testing.assert_allclose(expert_norm_table({"layers": per_layer}, unscanned), ref, rtol=1e-5)

    got = jax.jit(lambda p: expert_param_norms(p, cfg))(params)
    for r, i in enumerate(ids):
        med = float(np.median(ref[r]))
        np.testing.assert_allclose(got[f"moe/layer{i}/param_norm_max_over_median"],
                                   max(ref[r]) / med, rtol=1e-5)
        np.testing.assert_allclose(got[f"moe/layer{i}/param_norm_min_over_median"],
                                   min(ref[r]) / med, rtol=1e-5)
        np.testing.assert_allclose(got[f"moe_hist/layer{i}/param_norm"], ref[r], rtol=1e-5)
    np.testing.assert_allclose(got["moe/param_norm_max_over_median"],
                               max(max(n) / np.median(n) for n in ref), rtol=1e-5)


def test_expert_param_norms_needs_moe_layers():
    cfg = load_config(TINY, overrides=["moe_layers=[]", "scan_layers=false"])
    with pytest.raises(ValueError, match="no MoE layers"):
        expert_param_norms({"layers": {"layer_0": {"mlp": {"kernel": jnp.ones((2, 2))}}}}, cfg)


def test_tree_rms_traces_for_more_elements_than_int32_holds():
    """Step 3.5 Flash's update has 196e9 elements; the count must not become an int32 (it did,
    and its train step could not even be traced). Shapes only: nothing is allocated."""
    leaves = [jax.ShapeDtypeStruct((2**16, 2**16), jnp.float32),
              jax.ShapeDtypeStruct((3,), jnp.bfloat16)]
    out = jax.eval_shape(tree_rms, leaves)
    assert out.shape == () and out.dtype == jnp.float32
