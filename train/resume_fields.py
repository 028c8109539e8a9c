"""Which fields of a run config a resumed run may change, and the comparison that names the
others (training's; RL's adds its own fields, rl/resume.py)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from model.parallel.rules import MESH_AXES
from train.anticipatory_routing import AnticipatoryRoutingConfig
from train.optim.config import RESUMABLE_OPTIMIZER_CHANGES
from train.periodic_config import SampleConfig, TaskEvalConfig
from train.telemetry.wandb_sink import WandbConfig

# Fields that may change between a checkpoint and its resumption: implementation switches,
# run-length/logging knobs and the mesh (checkpoints are restored into any sharding).
# Everything else shapes the state or the data stream.
RESUMABLE_CHANGES = {
    *(f"mesh.{axis}" for axis in MESH_AXES), "mesh.zero1",
    "model.ep_collective", "model.pipeline_microbatches", "model.pipeline_virtual_stages",
    "model.attention_impl", "model.moe_impl", "model.moe.block_size", "model.remat_policy",
    "model.compute_dtype", "model.pipeline_stage_remat", "model.moe.ep_chunk_tokens",
    "train.steps", "train.log_every", "train.eval_every", "train.eval_batches",
    "train.checkpoint_every", "train.keep_checkpoints", "train.max_consecutive_skips",
    "train.peak_flops", "train.progress", "train.xla_cache_dir", "train.data.num_workers",
    "train.loss_chunk_size",
    *(f"train.wandb.{f.name}" for f in dataclasses.fields(WandbConfig)),
    "train.sample_every", *(f"train.{section}.{f.name}" for section, config in (
        ("eval_tasks", TaskEvalConfig), ("samples", SampleConfig),
        ("anticipatory_routing", AnticipatoryRoutingConfig)) for f in dataclasses.fields(config)),
    *(f"train.{field}" for field in RESUMABLE_OPTIMIZER_CHANGES),
}


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def incompatible_fields(saved: Mapping[str, Any], current: Mapping[str, Any],
                        resumable: frozenset[str] | set[str] = frozenset(RESUMABLE_CHANGES)
                        ) -> list[str]:
    """Dotted names of fields whose saved value differs from `current` (a run's `to_dict()`,
    compared after a JSON round trip, as the checkpoint stores it) and that a resumed run may
    not change (`resumable` lists those it may: by default a training run's)."""
    old, new = flatten(saved), flatten(_json_roundtrip(current))
    return sorted(k for k in set(old) | set(new) if k not in resumable and old.get(k) != new.get(k))


def _json_roundtrip(values: Any) -> Any:
    return json.loads(json.dumps(values))
