"""One optimizer update of the actor or the critic on a minibatch of rollouts (report 5.2.3:
one epoch over each iteration's rollouts, 4 actor and 12 critic minibatches).

A minibatch is a dict of [b, T] arrays: `tokens`, `segment_ids`, `mask`, and for the actor
`old_logp`, `infer_logp`, `advantages`, `ref_logp`, `select` (with the full-vocabulary
distillation signal also `teacher_hidden` [b, T, D], `teacher_id` [b] and `teacher_weight` [b],
rl/distill/; with Rollout Routing Replay `routed_experts` [b, L_moe, T, k], rl/routing_replay.py);
for the critic `returns`.
Updates with a non-finite loss or gradient are skipped, as in pre-training (train/step.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from model.config import ModelConfig
from model.lm import CausalLM, join_variables
from rl.config import RLConfig
from rl.distill.full_vocab import teacher_log_probs_fn
from rl.models import ValueModel, shift_right, token_logprobs
from rl.objectives import losses
from rl.objectives.kl import kl_terms
from rl.routing_replay import replay_metrics
from train.state import TrainState, apply_finite_update


# The clipped-surrogate algorithms and the (eps_low, eps_high) field each one reads.
CLIP_FIELDS = {"ppo": "ppo_clip", "dr_grpo": "ppo_clip", "grpo": "grpo_clip",
               "dapo": "dapo_clip"}


def actor_loss(rl: RLConfig, logp, mb, reverse_kl=None) -> tuple[jax.Array, dict]:
    """The configured algorithm's loss (`rl.objectives.losses`), aggregated as
    `rl.loss_aggregation` resolves, plus `rl.kl_coef` times the `rl.kl_estimator` KL terms, plus
    (full-vocabulary distillation) `rl.distill.teacher_coef` times each row's teacher weight
    (`mb["teacher_weight"]` [b], 0 without a teacher) times `reverse_kl` [b, T]; both
    aggregated like the loss (as GRPO's KL sits inside its per-sequence mean)."""
    common = {"mask": mb["mask"], "select": mb["select"], "aggregation": rl.aggregation,
              "max_length": rl.max_new_tokens}
    if rl.algorithm == "mopd":
        loss, stats = losses.mopd_loss(logp, mb["infer_logp"], mb["advantages"],
                                       ratio_bounds=rl.distill.ratio_bounds, **common)
    elif rl.algorithm == "mis_po":
        loss, stats = losses.mis_po_loss(logp, mb["old_logp"], mb["infer_logp"],
                                         mb["advantages"], token_bounds=rl.token_bounds,
                                         traj_bounds=rl.traj_bounds, **common)
    elif rl.algorithm == "kimi_k25":
        loss, stats = losses.kimi_k25_loss(logp, mb["infer_logp"], mb["advantages"],
                                           bounds=rl.kimi_bounds, tau=rl.kimi_tau, **common)
    elif rl.algorithm == "gspo":
        loss, stats = losses.gspo_loss(logp, mb["old_logp"], mb["infer_logp"], mb["advantages"],
                                       clip=rl.gspo_clip, token_bounds=rl.token_bounds,
                                       traj_bounds=rl.traj_bounds, **common)
    else:
        clip_low, clip_high = getattr(rl, CLIP_FIELDS[rl.algorithm])
        loss, stats = losses.ppo_clip_loss(logp, mb["old_logp"], mb["advantages"],
                                           clip_low=clip_low, clip_high=clip_high, **common)
    kl = kl_terms(rl.kl_method, logp, mb["old_logp"], mb["ref_logp"], mb["mask"])
    if rl.kl_weight:
        loss = loss + rl.kl_weight * losses.aggregate(kl, mb["mask"], rl.aggregation,
                                                      rl.max_new_tokens)
    if reverse_kl is not None:
        weights = mb["teacher_weight"][:, None] * mb["mask"]
        loss = loss + rl.distill.teacher_coef * losses.aggregate(
            reverse_kl * weights, mb["mask"], rl.aggregation, rl.max_new_tokens)
        rows = (mb["teacher_id"] >= 0).astype(jnp.float32)[:, None] * mb["mask"]
        stats = {**stats, "teacher_kl": losses.masked_mean(reverse_kl, rows)}
    return loss, {**stats, "kl": losses.masked_mean(kl, mb["mask"])}


def _apply_update(state: TrainState, optimizer, loss, grads) -> tuple[TrainState, dict]:
    state, _, stats = apply_finite_update(state, optimizer, loss, grads)
    return state, {"loss": loss, "grad_norm": stats["grad_norm"]}


def make_actor_step(model: CausalLM, optimizer: optax.GradientTransformation, rl: RLConfig,
                    teacher_configs: Sequence[ModelConfig] = ()
                    ) -> Callable[[TrainState, dict, tuple], tuple[TrainState, dict]]:
    """-> step(state, minibatch, teacher heads) -> (state, metrics). `teacher_configs` (one per
    teacher) and the heads' params (`rl.distill.full_vocab.head_params`, a tuple in the same
    order, () without them) turn on the full-vocabulary distillation term."""
    def step(state: TrainState, mb: dict, heads: tuple):
        def loss_fn(params):
            variables = join_variables(params, state.balance)
            teacher = None
            if heads:
                fn = teacher_log_probs_fn(teacher_configs, heads, model.config.vocab_size,
                                          rl.temperature)
                teacher = (fn, mb["teacher_hidden"], mb["teacher_id"])
            routes = mb.get("routed_experts")
            out = token_logprobs(model, variables, mb["tokens"], mb["segment_ids"],
                                 rl.temperature, teacher=teacher, routed_experts=routes)
            loss, stats = actor_loss(rl, out["logp"], mb, out.get("reverse_kl"))
            if routes is not None:
                stats.update({f"replay_{k}": v
                              for k, v in replay_metrics(out["replay_mismatch"], routes,
                                                         mb["mask"]).items()})
            return loss, stats

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state, metrics = _apply_update(state, optimizer, loss, grads)
        return state, {**metrics, **stats}

    return step


def value_loss(values, returns, mask):
    """0.5 * mean squared error of V(s_t) against the returns, over response tokens."""
    return 0.5 * losses.masked_mean((values - returns) ** 2, mask.astype(jnp.float32))


def make_critic_step(critic: ValueModel, optimizer: optax.GradientTransformation
                     ) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    def step(state: TrainState, mb: dict):
        def loss_fn(params):
            variables = join_variables(params, state.balance)
            values = shift_right(critic.apply(variables, mb["tokens"], mb["segment_ids"]))
            return value_loss(values, mb["returns"], mb["mask"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return _apply_update(state, optimizer, loss, grads)

    return step


def minibatches(batch: dict, count: int, rng: np.random.Generator) -> list[dict]:
    """Shuffles the rows of `batch` (dict of [B, ...] arrays) into `count` minibatches of equal
    size ceil(B / count); the short ones are topped up with copies of a row whose `mask` is 0,
    which change no loss (every loss divides by the mask's sum)."""
    rows = len(batch["mask"])
    size = -(-rows // count)
    order = rng.permutation(rows)
    order = np.concatenate([order, np.full(size * count - rows, order[0])])
    real = np.arange(size * count) < rows
    out = []
    for i in range(count):
        index, keep = order[i * size:(i + 1) * size], real[i * size:(i + 1) * size]
        mb = {k: v[index] for k, v in batch.items()}
        mb["mask"] = mb["mask"] * keep[:, None]
        out.append(mb)
    return out
