"""`TrainState`: everything a resumed run needs besides the data-iterator position."""

from typing import Any, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from model.lm import CausalLM
from train.config import RunConfig
from train.optim.optimizer import build_optimizer, param_labels
from model.parallel.rules import param_axes


class TrainState(flax.struct.PyTreeNode):
    step: jax.Array  # int32 []: batches consumed (skipped updates included)
    params: Any  # `params` collection, unboxed
    balance: Any  # `balance` collection (router biases), {} when the model has none
    opt_state: Any
    rng: jax.Array  # uint32 [2] raw key, split every step for stochastic extensions
    skipped: jax.Array  # int32 []: updates skipped for a non-finite loss or gradient, in total
    consecutive_skips: jax.Array  # int32 []: ... in a row (the loop stops at a limit)


def init_variables(model: CausalLM, key: jax.Array) -> dict:
    """Boxed (logically-partitioned) variables of `model`; shapes do not depend on length."""
    return model.init(key, jnp.zeros((1, 8), jnp.int32))


class Training(NamedTuple):
    """The static pieces of a run: the model, its optimizer, the optimizer group of every
    param ('muon' | 'adamw' | 'frozen', for the update-RMS metrics) and the logical axes of
    every variable ({'params': ..., 'balance': ...}, for the sharding rules)."""

    model: CausalLM
    optimizer: optax.GradientTransformation
    labels: Any
    variable_axes: dict


def build_training(run: RunConfig) -> Training:
    model = CausalLM(run.model)
    boxed = jax.eval_shape(lambda: init_variables(model, jax.random.key(0)))
    axes = param_axes(boxed)
    heads = run.trained_mtp_heads()
    variable_axes = {name: param_axes(tree) for name, tree in boxed.items()}
    return Training(model, build_optimizer(run.train, axes, heads),
                    param_labels(axes, run.train, heads), variable_axes)


def create_state(model: CausalLM, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    init_key, state_key = jax.random.split(jax.random.key(seed))
    return state_from_variables(nn.meta.unbox(init_variables(model, init_key)), optimizer,
                                state_key)


def state_from_variables(variables: dict, optimizer: optax.GradientTransformation,
                         key: jax.Array) -> TrainState:
    """A step-0 state around existing (unboxed) variables {"params", "balance"?}, e.g. a
    checkpoint RL starts from; `key` seeds the state's RNG."""
    params = variables["params"]
    zero = jnp.zeros((), jnp.int32)
    return TrainState(step=zero, params=params, balance=variables.get("balance", {}),
                      opt_state=optimizer.init(params), rng=jax.random.key_data(key),
                      skipped=zero, consecutive_skips=zero)


def abstract_state(training: Training, seed: int) -> TrainState:
    """Shapes and dtypes of the state (what a checkpoint restores into), without computing it."""
    return jax.eval_shape(lambda: create_state(training.model, training.optimizer, seed))
