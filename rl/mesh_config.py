"""`rl.mesh`: the device mesh of an RL run (rl/parallel.py), training's `mesh:` without its
pipeline and context axes."""

from __future__ import annotations

import dataclasses

from model.config import ConfigError
from train.config import MeshConfig


@dataclasses.dataclass(frozen=True)
class RLMeshConfig(MeshConfig):
    """`rl.mesh`: the training mesh (`mesh:` of a training run, docs/parallelism.md) for the
    actor, critic, reference policy and rollouts (rl/parallel.py). No pipeline or context axis:
    the decoder runs whole layers and sequences (model/layers/stack.py refuses KV caches)."""

    section = "rl.mesh"

    def validate(self) -> None:
        super().validate()
        for axis, refusal in (("pipeline", "pipeline"), ("context", "split sequences")):
            if getattr(self, axis) != 1:
                raise ConfigError(axis, f"RL does not {refusal} (rollouts decode with KV caches, "
                                  f"which need whole layers and sequences), got "
                                  f"{getattr(self, axis)}; use data, fsdp, expert or tensor")
