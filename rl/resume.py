"""Resuming an RL run: the saved run's config, with only what a resumed run may change taken
from the new command (run length, logging, evaluation and checkpoint cadence, the mesh, the
optimizer fields and the model's implementation switches training also lets a resume change).
The policy's model is compared as the command gives it: its `model:` section, or with
`--init-from` (or a section of QAT switches alone) its `model.qat` over the saved model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rl.config import RLRunConfig, rl_config_from_dict
from model.config import config_to_dict
from train.resume_fields import RESUMABLE_CHANGES as TRAINING_RESUMABLE, incompatible_fields
from train.loop import TrainingError
from train.optim.config import RESUMABLE_OPTIMIZER_CHANGES

# Fields a resumed run may change: run length, logging (W&B included), evaluation and checkpoint
# cadence, and the mesh (a checkpoint is restored into any sharding, as in training).
RESUMABLE_CHANGES = {"iterations", "log_every", "eval_every", "eval_prompts",
                     "checkpoint_every", "keep_checkpoints", "progress", "xla_cache_dir", "mesh",
                     "wandb"}


def resumed_config(run: RLRunConfig, saved: dict, workdir: Path, *,
                   init_from: bool = False) -> RLRunConfig:
    """The saved run's config (its model included) with this run's resumable fields; raises
    TrainingError naming the fields that differ otherwise. The saved config is compared as this
    version reads it, so a field added since it was saved counts at its default. `init_from`:
    the command passes --init-from, whose model's architecture the run already has."""
    saved_run = rl_config_from_dict(saved)
    policy = (run.model if run.model is not None and not init_from
              else run.with_model(saved_run.model, checkpoint=True).model)
    current = dataclasses.replace(run, model=policy)
    sections = lambda values: {k: values[k] for k in ("model", "rl", "task")}  # noqa: E731
    resumable = {f"rl.{k}" for k in RESUMABLE_CHANGES} | {
        f"rl.{model}.{field}" for model in ("actor", "critic")
        for field in RESUMABLE_OPTIMIZER_CHANGES} | {
        f"rl.{group}.{field}" for group in ("mesh", "wandb")
        for field in config_to_dict(getattr(run.rl, group))} | {
        field for field in TRAINING_RESUMABLE if field.startswith("model.")}
    changed = incompatible_fields(sections(saved_run.to_dict()), sections(current.to_dict()),
                                  resumable)
    if changed:
        raise TrainingError(f"cannot resume {workdir}: the config differs from the "
                            f"checkpoint's in {', '.join(changed)}; use another --workdir")

    def optimizer(model):  # the saved optimizer with this run's resumable fields
        saved_optimizer, current = getattr(saved_run.rl, model), getattr(run.rl, model)
        for field in RESUMABLE_OPTIMIZER_CHANGES:
            group, name = field.split(".")
            changed = dataclasses.replace(getattr(saved_optimizer, group),
                                          **{name: getattr(getattr(current, group), name)})
            saved_optimizer = dataclasses.replace(saved_optimizer, **{group: changed})
        return saved_optimizer

    rl = dataclasses.replace(saved_run.rl, **{k: getattr(run.rl, k) for k in RESUMABLE_CHANGES},
                             actor=optimizer("actor"), critic=optimizer("critic"))
    return dataclasses.replace(saved_run, model=policy, rl=rl)
