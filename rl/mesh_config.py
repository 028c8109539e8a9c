"""`rl.mesh`: the device mesh of an RL run (rl/parallel.py), training's `mesh:` without its
pipeline axis."""

from __future__ import annotations

import dataclasses

from model.config import ConfigError
from train.config import MeshConfig


@dataclasses.dataclass(frozen=True)
class RLMeshConfig(MeshConfig):
    """`rl.mesh`: the training mesh (`mesh:` of a training run, docs/parallelism.md) for the
    actor, critic, reference policy and rollouts (rl/parallel.py). No pipeline axis: the
    decoder runs whole layers (model/layers/stack.py refuses KV caches under one)."""

    section = "rl.mesh"

    def validate(self) -> None:
        super().validate()
        if self.pipeline != 1:
            raise ConfigError("pipeline", f"RL does not pipeline (rollouts decode with KV caches, "
                              f"which need whole layers), got {self.pipeline}; use data, fsdp, "
                              "expert or tensor")
