"""The train step as it runs on a mesh: one builder for training (train/loop.py) and for
`python -m train.plan --measure`, so that what the planner measures is what training compiles.

    layout = step_layout(run, mesh)                 # state and batch shardings
    step = jit_train_step(layout, run)              # training calls it on arrays
    with use_mesh(mesh):
        compiled = lower_train_step(layout, run).compile()   # no data, nothing allocated
        compiled.memory_analysis()

`lower_train_step` lowers the same jitted function on `jax.ShapeDtypeStruct`s that carry the
shardings the arrays would have: the state of `abstract_state` and a batch of the run's largest
step ([num_micro, micro_batch, T] of every feature the data pipeline yields).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from model.parallel.rules import named, replicated
from train.config import RunConfig
from train.data.packing import DTYPES, FEATURES
from train.parallel.sharding import batch_spec, state_specs
from train.state import Training, TrainState, abstract_state, build_training
from train.step import make_train_step


class StepLayout(NamedTuple):
    """What the jitted step is built from: the mesh, the run's static pieces, the state's shapes
    and the shardings of the state (a tree like it) and of every batch feature."""

    mesh: Mesh
    training: Training
    abstract_state: TrainState
    state_sharding: Any
    batch_sharding: NamedSharding


def step_layout(run: RunConfig, mesh: Mesh) -> StepLayout:
    training = build_training(run)
    state = abstract_state(training, run.train.seed)
    specs = state_specs(state, training.variable_axes, mesh, run)
    return StepLayout(mesh, training, state, named(mesh, specs), named(mesh, batch_spec(mesh)))


def jit_train_step(layout: StepLayout, run: RunConfig):
    """The jitted step: state and batch in their shardings, metrics replicated, the state
    donated (the new one reuses its buffers). Trace it under `use_mesh(layout.mesh)`."""
    step = make_train_step(layout.training, run)
    return jax.jit(step, in_shardings=(layout.state_sharding, layout.batch_sharding, None),
                   out_shardings=(layout.state_sharding, replicated(layout.mesh)),
                   donate_argnums=0)


def abstract_batch(layout: StepLayout, run: RunConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """The batch of the run's largest step (batch-size warm-up included), as sharded shapes."""
    micro = run.train.micro_batch()
    shape = (max(run.train.batch_sizes()) // micro, micro, run.train.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, DTYPES[k], sharding=layout.batch_sharding)
            for k in FEATURES}


def lower_train_step(layout: StepLayout, run: RunConfig) -> jax.stages.Lowered:
    """`jit_train_step` lowered on shapes alone (call under `use_mesh(layout.mesh)`)."""
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         layout.abstract_state, layout.state_sharding)
    mask_meta = jax.ShapeDtypeStruct((), np.bool_)
    return jit_train_step(layout, run).lower(state, abstract_batch(layout, run), mask_meta)
