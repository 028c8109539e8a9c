"""`TrainState`: everything a resumed run needs besides the data-iterator position."""

from typing import Any, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from model.lm import CausalLM, abstract_variables, init_variables, split_variables
from model.parallel.rules import param_axes
from train.config import RunConfig
from train.optim.optimizer import build_optimizer, param_labels
from train.optim.schedules import learning_rate_schedule


class TrainState(flax.struct.PyTreeNode):
    step: jax.Array  # int32 []: batches consumed (skipped updates included)
    params: Any  # `params` collection, unboxed
    balance: Any  # `balance` collection (router biases), {} when the model has none
    opt_state: Any
    rng: jax.Array  # uint32 [2] raw key, split every step for stochastic extensions
    skipped: jax.Array  # int32 []: updates skipped for a non-finite loss or gradient, in total
    consecutive_skips: jax.Array  # int32 []: ... in a row (the loop stops at a limit)


class Training(NamedTuple):
    """The static pieces of a run: the model, its optimizer and the learning-rate schedule that
    drives it (built once; the step logs from it), the optimizer group of every param
    ('muon' | 'adamw' | 'frozen', for the update-RMS metrics) and the logical axes of every
    variable ({'params': ..., 'balance': ...}, for the sharding rules)."""

    model: CausalLM
    optimizer: optax.GradientTransformation
    learning_rate: optax.Schedule
    labels: Any
    variable_axes: dict


def build_training(run: RunConfig) -> Training:
    model = CausalLM(run.model)
    boxed = abstract_variables(run.model)
    axes = param_axes(boxed)
    heads = run.trained_mtp_heads()
    variable_axes = {name: param_axes(tree) for name, tree in boxed.items()}
    schedule = learning_rate_schedule(**run.train.schedule_settings())
    settings = run.train.optimizer_settings()
    optimizer = build_optimizer(axes, learning_rate=schedule, trained_mtp_heads=heads, **settings)
    labels = param_labels(axes, optimizer=settings["optimizer"],
                          freeze_router=settings["freeze_router"], trained_mtp_heads=heads,
                          trainable=settings["trainable"])
    return Training(model, optimizer, schedule, labels, variable_axes)


def create_state(model: CausalLM, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    init_key, state_key = jax.random.split(jax.random.key(seed))
    return state_from_variables(nn.meta.unbox(init_variables(model, init_key)), optimizer,
                                state_key)


def state_from_variables(variables: dict, optimizer: optax.GradientTransformation,
                         key: jax.Array) -> TrainState:
    """A step-0 state around existing (unboxed) variables {"params", "balance"?}, e.g. a
    checkpoint RL starts from; `key` seeds the state's RNG."""
    params, balance = split_variables(variables)
    zero = jnp.zeros((), jnp.int32)
    return TrainState(step=zero, params=params, balance=balance,
                      opt_state=optimizer.init(params), rng=jax.random.key_data(key),
                      skipped=zero, consecutive_skips=zero)


def abstract_state(training: Training, seed: int) -> TrainState:
    """Shapes and dtypes of the state (what a checkpoint restores into), without computing it
    (the model's variable shapes are cached per config: `model.lm.abstract_variables`)."""
    variables = abstract_variables(training.model.config)
    return jax.eval_shape(lambda v: state_from_variables(nn.meta.unbox(v), training.optimizer,
                                                        jax.random.key(seed)), variables)


def tree_where(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def apply_finite_update(state: TrainState, optimizer: optax.GradientTransformation,
                        loss: jax.Array, grads: Any, balance: Any = None
                        ) -> tuple[TrainState, Any, dict[str, jax.Array]]:
    """One optimizer update of `state` (step + 1), skipped if `loss` or the gradient norm is
    not finite: params, balance and opt_state then keep their previous values and the skip
    counters go up (the loops stop after `max_consecutive_skips` in a row).

    grads: like `state.params`; balance: the updated `balance` collection (router biases) that
    goes with the update, None: unchanged. Returns (new state, the optimizer's updates,
    {"grad_norm": float32 [], "skipped": int32 [] 0 or 1}).
    """
    with jax.named_scope("optimizer"):  # profile attribution (benchmarks/gpu/profiling.py)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
    balance = state.balance if balance is None else balance
    skipped = (~finite).astype(jnp.int32)
    new_state = state.replace(
        step=state.step + 1,
        params=tree_where(finite, params, state.params),
        balance=tree_where(finite, balance, state.balance),
        opt_state=tree_where(finite, opt_state, state.opt_state),
        skipped=state.skipped + skipped,
        consecutive_skips=jnp.where(finite, 0, state.consecutive_skips + 1),
    )
    return new_state, updates, {"grad_norm": grad_norm, "skipped": skipped}
