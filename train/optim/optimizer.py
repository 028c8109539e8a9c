"""The optimizer: Muon on hidden matrices, AdamW on the rest, frozen router (report 3.1, 4.2.3).

    axes = param_axes(boxed_variables)                 # model.parallel.rules: logical axes
    schedule = learning_rate_schedule(lr=..., ...)     # train.optim.schedules, built once
    tx = build_optimizer(axes, learning_rate=schedule, weight_decay=0.1, ...)
    lr = schedule(applied_updates(opt_state))          # the rate the next update uses (logging)

Groups (labels, `param_labels`):
  muon   - hidden matrices, experts per expert, router (report 4.2.3), mHC's `fn` kernels, the
           grouped output projection per group (DeepSeek-V4 report 2.4: Muon for all other
           modules): scale_by_muon, decoupled weight decay, learning rate.
  adamw  - anything with a `vocab` axis (embedding, LM head, MTP output heads), params with
           fewer than 2 matrix axes (norm weights, attention sinks, mHC's static biases and
           gates) and bias tables (`BIAS_TABLE_AXES`): Adam, weight decay on the vocab matrices
           only, learning rate. With optimizer='adamw', every trained param.
  frozen - MoE router kernels when freeze_router (mid/post-training, report 3.2 / 4.2), MTP
           heads that the loss does not use (MTP-2/3 before their fine-tuning stage), and with
           trainable='indexer' everything but the CSA lightning indexers (their warm-up,
           DeepSeek-V4 report 4.2.2).
One schedule drives both groups: Muon's update-RMS matching (train.optim.muon.update_scale)
makes AdamW's learning rate and weight decay fit Muon too.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import jax
import optax

from train.optim.muon import batch_axes, scale_by_muon

_is_axes = lambda x: isinstance(x, tuple)  # noqa: E731  (axes tuples are leaves, not nodes)
# What trains: every param, or only the CSA lightning indexers (`indexer` submodules).
TRAINABLE = ("all", "indexer")

# Logical axes that only learned bias tables carry: the KV compressor's positional biases
# `position_bias` [m, 2c] ("compress_slot", "kv_lora"; DeepSeek-V4 report eqs. 11, 21). Two
# axes, but per-slot biases added to the compression logits, not a linear map, so they take
# AdamW without weight decay like mHC's static biases, which report 2.4 assigns to AdamW (the
# report names no optimizer for the compression biases themselves).
BIAS_TABLE_AXES = ("compress_slot",)


def _matrix_rank(axes: tuple[str, ...]) -> int:
    """Number of non-batch axes: 1 for a norm weight [L, D] or a sink [H], 2+ for matrices."""
    return len(axes) - len(batch_axes(axes))


def _is_matrix(axes: tuple[str, ...]) -> bool:
    """A linear map: weight decay, and Muon unless it has a `vocab` axis (not a bias, gate or
    norm weight)."""
    return _matrix_rank(axes) >= 2 and not any(a in BIAS_TABLE_AXES for a in axes)


def _label(path, axes: tuple[str, ...], optimizer: str, freeze_router: bool,
           trained_mtp_heads: int | None, trainable: str) -> str:
    name = getattr(path[-1], "key", None)
    if name == "router" and freeze_router:
        return "frozen"
    if trainable == "indexer" and "indexer" not in (getattr(k, "key", None) for k in path):
        return "frozen"
    head = re.fullmatch(r"mtp_(\d+)", str(getattr(path[0], "key", "")))
    if head and trained_mtp_heads is not None and int(head.group(1)) >= trained_mtp_heads:
        return "frozen"  # an MTP head outside the loss (report 2.2: only MTP-1 trains at first)
    if optimizer == "adamw" or "vocab" in axes or not _is_matrix(axes):
        return "adamw"
    return "muon"


def param_labels(axes_tree: Any, *, optimizer: str = "muon", freeze_router: bool = False,
                 trained_mtp_heads: int | None = None, trainable: str = "all") -> Any:
    """Tree of 'muon' / 'adamw' / 'frozen' labels, one per param of `axes_tree`.
    `trained_mtp_heads`: MTP heads `mtp_h` with h >= this are frozen (None: all train);
    `trainable`: one of TRAINABLE."""
    if trainable not in TRAINABLE:
        raise ValueError(f"trainable: expected one of {TRAINABLE}, got {trainable!r}")
    return jax.tree_util.tree_map_with_path(
        lambda p, a: _label(p, a, optimizer, freeze_router, trained_mtp_heads, trainable),
        axes_tree, is_leaf=_is_axes)


def build_optimizer(axes_tree: Any, *, learning_rate: optax.ScalarOrSchedule,
                    optimizer: str = "muon", weight_decay: float = 0.1, grad_clip: float = 1.0,
                    adam_b1: float = 0.9, adam_b2: float = 0.95, adam_eps: float = 1e-8,
                    muon: Mapping[str, Any] | None = None, freeze_router: bool = False,
                    trained_mtp_heads: int | None = None, trainable: str = "all"
                    ) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip) -> per-label group, see the module docstring.

    axes_tree: `param_axes(...)`, one logical-axis tuple per param. `muon`: keyword arguments
    of `scale_by_muon` (its defaults where None). Heads outside the loss (`trained_mtp_heads`,
    see param_labels) are frozen: no Muon work, no weight decay on them. Weight decay is
    decoupled: add_decayed_weights before the learning rate, so params shrink by
    lr * wd * param per step. Frozen params get zero updates and leave the clipping norm.
    """
    labels = param_labels(axes_tree, optimizer=optimizer, freeze_router=freeze_router,
                          trained_mtp_heads=trained_mtp_heads, trainable=trainable)
    decay_mask = jax.tree.map(lambda a: "vocab" in a or _is_matrix(a), axes_tree,
                              is_leaf=_is_axes)
    muon_group = optax.chain(
        scale_by_muon(axes_tree, **(muon or {})),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    adamw_group = optax.chain(
        optax.scale_by_adam(adam_b1, adam_b2, adam_eps),
        optax.add_decayed_weights(weight_decay, mask=decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )
    groups = optax.partition(
        {"muon": muon_group, "adamw": adamw_group, "frozen": optax.set_to_zero()}, labels)
    chain = []
    frozen = jax.tree.map(lambda label: label == "frozen", labels)
    if any(jax.tree.leaves(frozen)):  # a frozen gradient must not shrink the others by clipping
        chain.append(optax.masked(optax.set_to_zero(), frozen))
    if grad_clip > 0:
        chain.append(optax.clip_by_global_norm(grad_clip))
    return optax.chain(*chain, groups)


def applied_updates(opt_state: Any) -> jax.Array:
    """Number of updates applied so far (the learning-rate schedule's count; skipped steps
    that restore the previous opt_state do not advance it)."""
    counts = [s.count for s in jax.tree.leaves(
        opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
        if isinstance(s, optax.ScaleByScheduleState)]
    if not counts:
        raise ValueError("applied_updates: opt_state has no learning-rate schedule state")
    return counts[0]
