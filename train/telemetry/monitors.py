"""Stability monitors computed inside the jitted train step (report 3.3, 4.1.2, 4.1.3, 5.2.1).

Pure jnp functions from the model's MoE aux and the params to a flat dict of metrics; the
trainer hands that dict, still on device, to `train.telemetry.metrics.MetricsWriter` so logging
never waits for the step (report 3.3: asynchronous metrics).

Why these signals:
- 4.1.2 "expert collapse beyond routing collapse": an expert can die while dispatch looks healthy,
  visible as a falling min/median ratio of per-expert activation RMS or parameter norms.
- 4.1.3 "localized activation blow-up": one or two experts per deep layer whose output norm
  explodes while the median stays flat, visible as a rising max/median ratio.
- 5.2.1 routing confidence Σk: probability mass of the activated experts; low Σk means brittle
  routing under training/inference mismatch.

Names (`{i}` is the model layer index when `layer_ids` is given, e.g.
`cfg.moe_layer_indices()`, else the MoE-layer ordinal):
  moe/layer{i}/load_max_over_mean, load_min_over_mean   routed-load imbalance (f_e / mean f)
  moe/layer{i}/act_rms_{max,min}_over_median           SwiGLU intermediate RMS per expert
  moe/layer{i}/out_norm_{max,min}_over_median          mean output norm per expert
  moe/layer{i}/out_norm_peak                           largest single-token expert output norm
  moe/layer{i}/routing_confidence                      mean Σk over the batch
  moe/layer{i}/param_norm_{max,min}_over_median        Frobenius norm of each expert's weights
  moe/<same name>   summary over layers: max for `*_max_*` and `out_norm_peak`, min for
                    `*_min_*`, mean for routing_confidence; plus moe/dead_experts (total number
                    of (layer, expert) pairs that received no token).
  moe_hist/layer{i}/{load,act_rms,out_norm_mean,out_norm_max,param_norm} [E] raw per-expert
                    arrays (TensorBoard histograms only, never in metrics.jsonl).

Medians, maxima and minima of activation and output statistics are taken over the experts that
received tokens in the batch: an idle expert has no activation to measure (its zero would mask
expert-side collapse), and routing starvation already shows in load_min_over_mean and
dead_experts.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax.linen import meta as nn_meta

from model.config import ModelConfig
from model.layers.params import unstack_layers

# Per-layer statistics and how each is summarised over layers (the worst case, except Σk).
_SUMMARY = {"max": jnp.max, "min": jnp.min, "mean": jnp.mean}
_HIST_KEYS = ("expert_load", "expert_act_rms", "expert_out_norm_mean", "expert_out_norm_max")


def tree_rms(tree) -> jax.Array:
    """Root mean square over every element of every leaf (e.g. the RMS of an update)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    total = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)
    # a Python float: the element count of a large model (196e9) overflows JAX's int32
    return jnp.sqrt(total / float(sum(x.size for x in leaves)))


def _ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den with den clamped to the smallest normal float32 (0 / 0 -> 0, not NaN)."""
    return num / jnp.maximum(den, jnp.finfo(jnp.float32).tiny)


def _dispersion(values: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """[L, E] -> (max / median, min / median) per layer, over the experts where `mask` holds."""
    if mask is not None:
        values = jnp.where(mask, values, jnp.nan)
    median = jnp.nanmedian(values, axis=-1)
    return (_ratio(jnp.nanmax(values, axis=-1), median),
            _ratio(jnp.nanmin(values, axis=-1), median))


def _summary_kind(name: str) -> str:
    if name == "routing_confidence":
        return "mean"
    return "min" if "_min_" in name else "max"


def _flatten(per_layer: dict[str, jax.Array], hist: dict[str, jax.Array],
             layer_ids: Sequence[int] | None) -> dict[str, jax.Array]:
    """{stat: [L]} and {stat: [L, E]} -> flat per-layer scalars, summaries and histograms."""
    num_layers = next(iter({**per_layer, **hist}.values())).shape[0]
    ids = list(range(num_layers)) if layer_ids is None else list(layer_ids)
    if len(ids) != num_layers:
        raise ValueError(f"layer_ids: {len(ids)} ids for {num_layers} MoE layers")
    out: dict[str, jax.Array] = {}
    for name, values in per_layer.items():
        out[f"moe/{name}"] = _SUMMARY[_summary_kind(name)](values)
        out.update({f"moe/layer{i}/{name}": values[r] for r, i in enumerate(ids)})
    for name, values in hist.items():
        out.update({f"moe_hist/layer{i}/{name}": values[r] for r, i in enumerate(ids)})
    return out


def moe_monitors(aux_moe: Mapping[str, jax.Array],
                 layer_ids: Sequence[int] | None = None) -> dict[str, jax.Array]:
    """Stacked per-MoE-layer aux (`out.aux['moe']`: [L, E] and [L, B, T] arrays) -> flat dict of
    scalar monitors plus `moe_hist/...` per-expert arrays (see the module docstring).

    Needs `expert_load`; the other statistics are used when present.
    """
    aux = {k: jax.lax.stop_gradient(jnp.asarray(v, jnp.float32)) for k, v in aux_moe.items()}
    load = aux["expert_load"]
    active = aux["expert_tokens"] > 0 if "expert_tokens" in aux else load > 0
    mean_load = jnp.mean(load, axis=-1)
    per_layer = {"load_max_over_mean": _ratio(jnp.max(load, axis=-1), mean_load),
                 "load_min_over_mean": _ratio(jnp.min(load, axis=-1), mean_load)}
    for name, key in (("act_rms", "expert_act_rms"), ("out_norm", "expert_out_norm_mean")):
        if key in aux:
            high, low = _dispersion(aux[key], active)
            per_layer[f"{name}_max_over_median"], per_layer[f"{name}_min_over_median"] = high, low
    if "expert_out_norm_max" in aux:
        per_layer["out_norm_peak"] = jnp.max(aux["expert_out_norm_max"], axis=-1)
    if "routing_confidence" in aux:
        conf = aux["routing_confidence"]
        per_layer["routing_confidence"] = jnp.mean(conf.reshape(conf.shape[0], -1), axis=-1)
    hist = {k.removeprefix("expert_"): aux[k] for k in _HIST_KEYS if k in aux}
    out = _flatten(per_layer, hist, layer_ids)
    out["moe/dead_experts"] = jnp.sum(~active).astype(jnp.float32)
    return out


# ---------------------------------------------------------------------------------------------
# Expert parameter norms (report 4.1.2: "Frobenius norms of expert projection matrices").

_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def expert_norm_table(params, cfg: ModelConfig) -> jax.Array:
    """[L_moe, E] Frobenius norm of each expert's weights (gate, up and down together), MoE
    layers in model order; `params` in the layout `cfg.scan_layers` says."""
    layers = nn_meta.unbox(params)["layers"]
    per_layer = unstack_layers(layers, cfg) if cfg.scan_layers else layers
    rows = []
    for i in cfg.moe_layer_indices():
        moe = per_layer[f"layer_{i}"]["moe"]
        squares = sum(jnp.sum(jnp.square(moe[k].astype(jnp.float32)), axis=(-2, -1))
                      for k in _EXPERT_WEIGHTS)
        rows.append(jnp.sqrt(jax.lax.stop_gradient(squares)))
    if not rows:
        raise ValueError("expert_norm_table: the model has no MoE layers")
    return jnp.stack(rows)


def expert_param_norms(params, cfg: ModelConfig) -> dict[str, jax.Array]:
    """Per MoE layer: max/median and min/median of the per-expert weight norms, summaries over
    layers, and `moe_hist/layer{i}/param_norm` [E] for histograms."""
    norms = expert_norm_table(params, cfg)
    high, low = _dispersion(norms)
    return _flatten({"param_norm_max_over_median": high, "param_norm_min_over_median": low},
                    {"param_norm": norms}, cfg.moe_layer_indices())
