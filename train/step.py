"""The jitted training step: gradient accumulation over micro-batches, losses, the optimizer,
the loss-free router-bias update, non-finite skipping, and the stability monitors.

    step_fn = make_train_step(build_training(run), run)
    state, metrics = step_fn(state, batch, mask_meta)

batch: dict of `tokens`, `segment_ids`, `positions` (int32), `meta_mask` and optionally
`loss_mask` (bool; absent: every token is a target), each [num_micro, micro_batch, T], and
`routed_experts` [num_micro, micro_batch, L_moe, T, k] to replay an expert choice
(train/anticipatory_routing.py);
mask_meta: bool scalar (report A.3 switch). Metrics stay on device: the caller hands them to the
background writer without waiting.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model.lm import CausalLM, join_variables, learned_routing_mean, output_head_params
from model.parallel.mesh import mesh_axis_size
from model.parallel.pipeline import stage_plan
from train.balance import has_router_bias, update_router_bias
from train.config import RunConfig
from train.losses import chunked_cross_entropy, shifted_targets
from train.optim.optimizer import applied_updates
from train.optim.schedules import decay_start
from train.parallel.compute_params import compute_params
from train.parallel.sharding import shards_master_weights, stored_param_specs
from train.state import Training, TrainState, apply_finite_update
from train.telemetry.monitors import expert_param_norms, moe_monitors, tree_rms


def loss_fn(model: CausalLM, run: RunConfig, params, balance, micro, mask_meta, counts,
            num_micro: int, mtp_weight=None):
    """Loss of one micro-batch, normalised by the whole step's target counts `counts`
    ([1 + heads] float32) and, for the per-micro-batch balance loss, by `num_micro`, so that
    summed micro-batch losses and gradients equal those of the full batch. `mtp_weight`: the
    MTP loss weight of this step (`mtp_weight_at`; None: train.mtp_loss_weight).

    Returns (loss, (parts dict of scalars, aux of the model))."""
    train = run.train
    mtp_weight = train.mtp_loss_weight if mtp_weight is None else mtp_weight
    heads = run.trained_mtp_heads()
    variables = join_variables(params, balance)
    routes = micro.get("routed_experts")
    out = model.apply(variables, micro["tokens"], micro["segment_ids"], micro["positions"],
                      compute_logits=False, num_mtp_heads=heads,
                      routed_experts=None if routes is None else jnp.swapaxes(routes, 0, 1))

    def head_loss(hidden, offset, head):
        targets = shifted_targets(micro["tokens"], micro["segment_ids"], micro["meta_mask"],
                                  offset, mask_meta, micro.get("loss_mask"))
        project = lambda p, h: model.apply({"params": p}, h, head=head,  # noqa: E731
                                           method=CausalLM.project)
        total, _ = chunked_cross_entropy(project, output_head_params(run.model, params, head),
                                         hidden, targets, train.loss_chunk_size)
        return total / jnp.maximum(counts[head], 1.0)

    lm = head_loss(out.hidden, 1, 0)
    mtp = jnp.zeros((), jnp.float32)
    for h in range(heads):
        mtp += train.mtp_offset_weights[h] * head_loss(out.mtp_hidden[h], 2 + h, h + 1)
    balance_loss = out.aux.get("balance_loss", jnp.zeros((), jnp.float32))
    parts = {"loss/lm": lm, "loss/mtp": mtp, "loss/balance": balance_loss}
    # The balance and indexer losses are per-micro-batch means (the step averages them):
    # /num_micro sums to the batch mean.
    loss = lm + mtp_weight * mtp + train.balance_loss_coef * balance_loss / num_micro
    for name, key, coef in (("loss/sequence_balance", "sequence_balance_loss",
                             train.sequence_balance_coef),
                            ("loss/indexer", "indexer_loss", train.indexer_loss_coef)):
        if key in out.aux:  # DeepSeek-V4's terms: MoE layers / CSA layers present
            parts[name] = out.aux[key]
            loss = loss + coef * parts[name] / num_micro
    if "indexer_recall" in out.aux:  # dense CSA layers: the indexer's top-k recall
        parts["indexer/recall"] = out.aux["indexer_recall"]
    return loss, (parts, out.aux)


def mtp_weight_at(run: RunConfig, count):
    """The MTP loss weight of the update after `count` applied updates (the learning-rate
    schedule's count): train.mtp_loss_weight, then train.mtp_loss_weight_at_decay from the
    step the learning rate starts to decay (a step of the whole schedule: see
    train.schedule_offset)."""
    train = run.train
    if train.mtp_loss_weight_at_decay is None:
        return train.mtp_loss_weight
    start = decay_start(**train.schedule_settings())
    return jnp.where(count + train.schedule_offset >= start, train.mtp_loss_weight_at_decay,
                     train.mtp_loss_weight)


def stop_frozen_gradients(params, labels):
    """`params` with the optimizer's frozen ones behind stop_gradient: their gradient is zero
    anyway, and this way the backward pass skips what only they need (an indexer warm-up,
    train.trainable=indexer, differentiates the indexer alone)."""
    return jax.tree.map(lambda p, label: jax.lax.stop_gradient(p) if label == "frozen" else p,
                        params, labels)


def target_counts(run: RunConfig, batch: dict, mask_meta) -> jax.Array:
    """Trained targets of the main head and each trained MTP head over the whole step. [1+heads]"""
    flat = {k: v.reshape(-1, v.shape[-1]) for k, v in batch.items()}
    return jnp.stack([
        jnp.sum(shifted_targets(flat["tokens"], flat["segment_ids"], flat["meta_mask"], offset,
                                mask_meta, flat.get("loss_mask")).weights)
        for offset in range(1, 2 + run.trained_mtp_heads())])


def grouped_rms(tree, labels) -> dict[str, jax.Array]:
    """RMS of `tree`'s entries per optimizer label group ('muon', 'adamw')."""
    leaves, groups = jax.tree.leaves(tree), jax.tree.leaves(labels)
    return {f"update_rms/{group}": tree_rms([x for x, g in zip(leaves, groups) if g == group])
            for group in sorted(set(groups) - {"frozen"})}


def stored_layout(tree, training: Training, run: RunConfig):
    """`tree` (like the stored params) constrained to the stored params' layout under the
    current mesh (a gradient sum kept like the master weights: 1/data of it per device under
    ZeRO-1 with mixed precision); unchanged without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tree
    specs = stored_param_specs(training.variable_axes["params"], tree, mesh, run.model,
                               shards_master_weights(run))
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, specs,
                        is_leaf=lambda x: isinstance(x, P))


def make_train_step(training: Training, run: RunConfig
                    ) -> Callable[[TrainState, dict, Any], tuple[TrainState, dict]]:
    """The (unjitted) step of `training` = build_training(run)."""
    optimizer, labels = training.optimizer, training.labels
    learning_rate = training.learning_rate
    train = run.train

    def step_fn(state: TrainState, batch: dict, mask_meta) -> tuple[TrainState, dict]:
        counts = target_counts(run, batch, mask_meta)
        num_micro = batch["tokens"].shape[0]
        mtp_weight = mtp_weight_at(run, applied_updates(state.opt_state))
        # The params the micro-batches compute with, made once: compute dtype, stage layout
        # (train/parallel/compute_params.py); the pullback returns float32 gradients in the
        # stored layout (a reduce-scatter under sharded master weights).
        compute, to_stored = jax.vjp(
            lambda p: compute_params(p, training.variable_axes["params"], run.model,
                                     run.trained_mtp_heads()), state.params)
        model = training.model
        if mesh_axis_size("pipeline") > 1:
            model = model.clone(staged_pipeline=True)

        def trained_loss(params, *args):
            return loss_fn(model, run, stop_frozen_gradients(params, labels), *args)

        grad_and_aux = jax.value_and_grad(trained_loss, has_aux=True)

        def accumulate(grads, micro):
            (loss, (parts, aux)), g = grad_and_aux(compute, state.balance, micro, mask_meta,
                                                   counts, num_micro, mtp_weight)
            # the experts of every token (aux moe.routed_experts) are not a monitor
            moe, mtp_moe = ({k: v for k, v in aux.get(key, {}).items() if k != "routed_experts"}
                            for key in ("moe", "mtp_moe"))
            g = stored_layout(to_stored(g)[0], training, run)
            return jax.tree.map(jnp.add, grads, g), (loss, parts, moe, mtp_moe)

        zeros = stored_layout(jax.tree.map(jnp.zeros_like, state.params), training, run)
        grads, (losses, parts, moe_aux, mtp_moe_aux) = jax.lax.scan(accumulate, zeros, batch)
        # lm/mtp terms are normalised by whole-step counts: sum them; the balance and indexer
        # losses are per-micro-batch means: average them.
        parts = {k: jnp.sum(v) if k in ("loss/lm", "loss/mtp") else jnp.mean(v)
                 for k, v in parts.items()}
        loss = jnp.sum(losses)
        moe_aux, mtp_moe_aux = jax.tree.map(lambda x: jnp.mean(x, axis=0), (moe_aux, mtp_moe_aux))

        balance = None
        if has_router_bias(run.model) and train.router_bias_rate:
            balance = update_router_bias(state.balance, moe_aux.get("expert_load"), run.model,
                                         train.router_bias_rate, mtp_moe_aux.get("expert_load"))
        new_state, updates, update_stats = apply_finite_update(state, optimizer, loss, grads,
                                                               balance)
        new_state = new_state.replace(
            rng=jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0]))
        metrics = {"loss": loss, **parts, **update_stats,
                   # share of the step's positions whose next token is a target (chat SFT:
                   # the assistant turns; plain text: all but document ends and padding)
                   "trained_fraction": counts[0] / float(batch["tokens"].size),
                   "lr": learning_rate(applied_updates(state.opt_state)),  # this update's rate
                   "skipped_steps": new_state.skipped,
                   **({"mtp_weight": mtp_weight}
                      if train.mtp_loss_weight_at_decay is not None else {}),
                   "consecutive_skips": new_state.consecutive_skips,
                   **grouped_rms(updates, labels)}
        stages = mesh_axis_size("pipeline")
        if stages > 1:
            metrics["pipeline/bubble_fraction"] = jnp.float32(
                stage_plan(run.model, stages).bubble)
        if "replay_mismatch" in moe_aux:  # anticipatory routing's replayed choice
            metrics["anticipatory_routing/mismatch"] = jnp.mean(
                learned_routing_mean(run.model, moe_aux.pop("replay_mismatch")))
        if moe_aux:
            metrics.update(moe_monitors(moe_aux, run.model.moe_layer_indices()))
            metrics.update(expert_param_norms(new_state.params, run.model))
        return new_state, metrics

    return step_fn
