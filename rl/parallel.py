"""RL under the training mesh (report 3.2): the actor, critic and reference policy laid out as
training lays out its state, and rollout rows split as training splits its batches.

    mesh = rl_mesh(rl.mesh)                       # `rl.mesh.data=2 rl.mesh.expert=2 ...`
    check_rows_fit(rl, mesh)
    shardings = rl_state_shardings(abstract_state, actor_boxed, critic_boxed, mesh, model, zero1)
    with use_mesh(mesh):                          # model.parallel.rules; run_rl enters it
        ...

What is sharded, and how (docs/parallelism.md):
- the actor's and the critic's `TrainState`: params and router biases by the model's rules
  table (heads, FFN hidden and vocabulary over `tensor`, `embed` over `fsdp`, routed experts
  over `expert`), optimizer states like their params and, with `rl.mesh.zero1`, also over
  `data` (ZeRO-1); the reference params exactly as the actor's params;
- rollout rows [B, ...] (old and reference log-probs, values, every actor and critic
  minibatch, the replayed experts of `rl.routing_replay`) over the data-parallel axes `data` x
  `fsdp` x `expert`; the batches waiting with `rl.max_staleness` (rl/staleness.py) replicated;
- decoding (rollouts and held-out evaluation): the decoder runs with the sharded actor weights
  under the mesh. Its activations carry the model's logical constraint (rows over the
  data-parallel axes) and MoE layers send their tokens to the experts' devices
  (model.parallel.expert_parallel); token ids and KV caches take the layout XLA propagates from
  there, the decoder passes no shardings of its own.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from model.lm import join_variables, split_variables
from model.parallel.rules import named, param_axes, replicated
from rl.config import RLConfig, RLMeshConfig
from rl.models import critic_config
from train.loop import TrainingError
from train.parallel.sharding import batch_spec, data_parallel_size, make_mesh, model_state_specs


def rl_mesh(cfg: RLMeshConfig, devices: list | None = None) -> Mesh:
    """The training mesh of `rl.mesh` over `devices` (default: all); a mesh that does not fit
    them is a one-line error naming `rl.mesh`."""
    try:
        return make_mesh(cfg, devices)
    except ValueError as err:  # "mesh: ..." from MeshConfig.axis_sizes
        raise TrainingError(f"rl.{err}") from None


def check_rows_fit(rl: RLConfig, mesh: Mesh) -> None:
    """Every batch of rows splits evenly over the data-parallel devices: an iteration's
    rollouts (decoded together, as is each held-out evaluation batch) and every actor and
    critic minibatch (ceil(B / count) rows, `rl.update.minibatches`). MoE layers dispatch each
    device's own rows (model.parallel.expert_parallel), so an uneven split cannot run."""
    ways = data_parallel_size(mesh)
    where = f"the {ways} data-parallel devices (rl.mesh data x fsdp x expert)"
    if rl.batch_size % ways:
        raise TrainingError(f"rl.prompts_per_iteration x rl.samples_per_prompt: "
                            f"{rl.batch_size} rollouts do not split over {where}")
    for name in ("actor", "critic") if rl.uses_critic else ("actor",):
        count = getattr(rl, f"{name}_minibatches")
        size = -(-rl.batch_size // count)
        if size % ways:
            raise TrainingError(f"rl.{name}_minibatches: {count} minibatches of {size} rollouts "
                                f"do not split over {where}")


def row_sharding(mesh: Mesh) -> NamedSharding:
    """[B, ...] arrays: rows over the data-parallel axes, the other dimensions whole."""
    return NamedSharding(mesh, P(batch_spec(mesh)[1]))


def sharded_jit(fn: Callable, in_shardings: tuple, out_shardings: Any,
                donate_argnums: tuple[int, ...] = ()) -> Callable:
    """`jax.jit(fn)` with fixed shardings whose arguments are first moved into them: jit
    refuses a committed array of another layout, e.g. rows made by `jnp.asarray` under the
    mesh (replicated). Arguments already in place are not copied."""
    jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                     donate_argnums=donate_argnums)
    return lambda *args: jitted(*jax.device_put(args, in_shardings))


def variables_sharding(state_sharding: Any) -> dict:
    """The `apply` variables' shardings of a `TrainState`'s shardings (as `join_variables`)."""
    return join_variables(state_sharding.params, state_sharding.balance)


def place_variables(variables: dict, actor_sharding: Any) -> dict:
    """Unboxed policy variables {"params", "balance"?} (a random init or a loaded checkpoint)
    moved into the actor's layout (`rl_state_shardings(...).actor`)."""
    return jax.device_put(join_variables(*split_variables(variables)),
                          variables_sharding(actor_sharding))


def rl_state_shardings(abstract: Any, actor_boxed: dict, critic_boxed: dict | None, mesh: Mesh,
                       model: ModelConfig, zero1: bool) -> Any:
    """NamedShardings of an `RLState` (rl/trainer.py), the structure of `abstract` (its
    `jax.eval_shape`). actor_boxed / critic_boxed: the boxed abstract variables of the policy
    and the value model (their logical axes); critic_boxed None without a critic."""
    def train_state(state, boxed, config):
        axes = {name: param_axes(tree) for name, tree in boxed.items()}
        return named(mesh, model_state_specs(state, axes, mesh, config, zero1))

    actor = train_state(abstract.actor, actor_boxed, model)
    critic = (None if abstract.critic is None
              else train_state(abstract.critic, critic_boxed, critic_config(model)))
    waiting = ({"buffer": jax.tree.map(lambda _: replicated(mesh), abstract.buffer)}
               if hasattr(abstract, "buffer") else {})
    return abstract.replace(actor=actor, critic=critic,
                            reference=actor.params if abstract.reference else {},
                            iteration=replicated(mesh), **waiting)
