"""The recipe file format and its loader (the runner is `recipe.py`, which documents the
format): a recipe's stages, the run config of each, and one learning-rate schedule that the
stages may share.

`schedule:` (optional) lists the `train.*` overrides of one schedule (`train.lr`,
`train.warmup_steps`, `train.schedule`, `train.min_lr`, `train.lr_stages`) spanning the stages
that follow it, in order: their `train.steps` add up to its length and each trains its slice
(`train.schedule_offset`, `train.schedule_steps`), so a decay runs on across a stage boundary
as in one run. A stage with `own_schedule: true` (an indexer warm-up that trains other params)
keeps its own and does not move the shared one on.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Sequence

from model.config import ModelConfig, apply_overrides, parse_override, read_yaml
from train.config import RunConfig, TrainConfig, load_run_config
from train.experiments.spec import override_list, read_spec
from train.init_from import model_changes

RECIPE_KEYS = ("stages", "schedule")  # besides spec.COMMON_KEYS
STAGE_KEYS = ("name", "overrides", "clone_mtp", "own_schedule", "reset_optimizer")
# The fields of a learning-rate schedule; the last two place a stage in a shared one.
SCHEDULE_FIELDS = ("train.lr", "train.warmup_steps", "train.schedule", "train.min_lr",
                   "train.lr_stages", "train.schedule_offset", "train.schedule_steps")
# A stage's name becomes a directory name, DIR/stages/<kk>-<name>: portable characters only.
STAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    overrides: tuple[str, ...]
    clone_mtp: bool = False  # at the start of the stage, every MTP head becomes a copy of MTP-1
    own_schedule: bool = False  # with a recipe `schedule`: this stage keeps its own
    reset_optimizer: bool = False  # start with a new optimizer state (else carried on)


@dataclasses.dataclass(frozen=True)
class Recipe:
    base: Path
    overrides: tuple[str, ...]
    stages: tuple[Stage, ...]
    description: str = ""
    schedule: tuple[str, ...] = ()  # one learning-rate schedule shared by the stages

    def follows_schedule(self, index: int) -> bool:
        return bool(self.schedule) and not self.stages[index].own_schedule

    def stage_steps(self, index: int, extra: Sequence[str] = ()) -> int:
        """`train.steps` of stage `index`, read before its config is resolved (the shared
        schedule's span depends on it)."""
        stage = self.stages[index]
        values = read_yaml(self.base)
        values = apply_overrides(values if "train" in values else {"train": {}},
                                 [*self.overrides, *stage.overrides, *extra])
        steps = (values.get("train") or {}).get("steps", TrainConfig.steps)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"recipe stage {stage.name}: train.steps: must be an integer "
                             f">= 1, got {steps!r}")
        return steps

    def schedule_span(self, extra: Sequence[str] = ()) -> list[tuple[int, int]]:
        """(index, train.steps) of the stages that follow the shared schedule, in order."""
        return [(i, self.stage_steps(i, extra)) for i in range(len(self.stages))
                if self.follows_schedule(i)]

    def schedule_config(self, extra: Sequence[str] = ()) -> RunConfig | None:
        """The shared schedule as one run over all the steps of the stages following it (the
        stages' learning rates, joined, are this run's); None without a shared schedule."""
        if not self.schedule:
            return None
        total = sum(steps for _, steps in self.schedule_span(extra))
        return load_run_config(self.base, [*self.overrides, *self.schedule, *extra,
                                           f"train.steps={total}"])

    def stage_config(self, index: int, extra: Sequence[str] = ()) -> RunConfig:
        """Run config of stage `index` (0-based): base, recipe overrides, its slice of the
        shared schedule, the stage's overrides, `extra`; the data seed is offset by the stage
        index; only the first stage keeps `train.init_from`."""
        place = []
        if self.follows_schedule(index):
            span = self.schedule_span(extra)
            offset = sum(steps for i, steps in span if i < index)
            place = [*self.schedule, f"train.schedule_offset={offset}",
                     f"train.schedule_steps={sum(steps for _, steps in span)}"]
        run = load_run_config(self.base, [*self.overrides, *place,
                                          *self.stages[index].overrides, *extra])
        # A later stage starts from the previous one's weights, whatever `train.init_from` says
        return dataclasses.replace(run, train=dataclasses.replace(
            run.train, seed=run.train.seed + index,
            init_from=run.train.init_from if index == 0 else ""))

    def stage_dir(self, workdir: Path, index: int) -> Path:
        return Path(workdir) / "stages" / f"{index + 1:02d}-{self.stages[index].name}"


def _stage(entry, i: int, has_schedule: bool) -> Stage:
    if not isinstance(entry, dict) or "name" not in entry or set(entry) - set(STAGE_KEYS):
        raise ValueError(f"recipe stages[{i}]: expected a mapping of {', '.join(STAGE_KEYS)} "
                         f"(name required), got {entry!r}")
    name = entry["name"]
    if isinstance(name, bool) or not isinstance(name, (str, int)) or not STAGE_NAME.fullmatch(
            str(name)):
        raise ValueError(f"recipe stages[{i}].name: {str(name)[:80]!r} is not a usable "
                         "directory name: 1-64 letters, digits, '.', '_' or '-', not starting "
                         "with '.', '_' or '-'")
    flags = {}
    for key in ("clone_mtp", "own_schedule", "reset_optimizer"):
        flags[key] = entry.get(key, False)
        if not isinstance(flags[key], bool):
            raise ValueError(f"recipe stages[{i}].{key}: expected true or false, "
                             f"got {flags[key]!r}")
    if flags["clone_mtp"] and i == 0:
        raise ValueError("recipe stages[0].clone_mtp: the first stage has no MTP-1 to clone")
    if flags["own_schedule"] and not has_schedule:
        raise ValueError(f"recipe stages[{i}].own_schedule: the recipe has no shared "
                         "`schedule` (every stage has its own)")
    overrides = override_list(entry.get("overrides"), f"recipe stages[{i}].overrides")
    if has_schedule and not flags["own_schedule"]:
        for override in overrides:
            if parse_override(override)[0] in SCHEDULE_FIELDS:
                raise ValueError(f"recipe stage {name}: {override!r} sets the recipe's shared "
                                 "schedule; set it in `schedule`, or give the stage "
                                 "`own_schedule: true`")
    return Stage(str(name), overrides, **flags)


def _schedule(values, path: Path) -> tuple[str, ...]:
    overrides = override_list(values, "recipe schedule")
    keys = [parse_override(o)[0] for o in overrides]
    wrong = [k for k in keys if k not in SCHEDULE_FIELDS[:5]]
    if wrong:
        raise ValueError(f"recipe {path}: schedule: {wrong[0]} is not a schedule field; "
                         f"expected {', '.join(SCHEDULE_FIELDS[:5])}")
    if overrides and "train.warmup_steps" not in keys:
        raise ValueError(f"recipe {path}: schedule: give train.warmup_steps (the warm-up of "
                         "the whole schedule)")
    return overrides


def load_recipe(path: str | Path, extra: Sequence[str] = ()) -> Recipe:
    """Reads and checks a recipe file; every stage's config (with the command line's `extra`
    overrides) is resolved here, so a mistake in a late stage fails before the first trains."""
    spec = read_spec(path, "recipe", RECIPE_KEYS)
    entries = spec.values.get("stages")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"recipe {spec.path}: 'stages' must be a non-empty list")
    schedule = _schedule(spec.values.get("schedule"), spec.path)
    stages = tuple(_stage(entry, i, bool(schedule)) for i, entry in enumerate(entries))
    names = [s.name for s in stages]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"recipe {spec.path}: stage name {twice!r} is given twice")
    recipe = Recipe(spec.base, spec.overrides, stages, spec.description, schedule)
    if schedule:
        _check_schedule(recipe, extra)
    previous = None
    for i, stage in enumerate(recipe.stages):
        try:
            run = recipe.stage_config(i, extra)
        except ValueError as err:
            raise ValueError(f"recipe stage {stage.name}: {err}") from None
        if stage.clone_mtp and run.model.mtp.num_heads < 2:
            raise ValueError(f"recipe stage {stage.name}: clone_mtp needs model.mtp.num_heads "
                             f">= 2, got {run.model.mtp.num_heads}")
        if previous is not None:
            _check_continues(previous, run.model, recipe.stages[i - 1].name, stage.name)
        previous = run.model
    return recipe


def _check_schedule(recipe: Recipe, extra: Sequence[str]) -> None:
    span = recipe.schedule_span(extra)
    if not span:
        raise ValueError("recipe schedule: every stage has `own_schedule: true`; drop the "
                         "shared schedule or a stage's flag")
    try:
        recipe.schedule_config(extra)
    except ValueError as err:
        steps = " + ".join(f"{recipe.stages[i].name} {n}" for i, n in span)
        raise ValueError(f"recipe schedule (over the stages that follow it: {steps} = "
                         f"{sum(n for _, n in span)} steps): {err}") from None


def _check_continues(before: ModelConfig, after: ModelConfig, before_name: str,
                     name: str) -> None:
    """Stage `name` starts from stage `before_name`'s weights, so its model must have the same
    parameters and shapes (ValueError naming the model fields that change them). Changes of
    RoPE settings, windows and implementation switches keep them (`train.init_from`'s check)."""
    changed, _ = model_changes(before, after)
    if changed:
        shown = ", ".join(map(str, changed[:3]))
        raise ValueError(f"recipe stage {name}: {shown} change the model's parameters from "
                         f"stage {before_name}'s; a stage continues the previous stage's "
                         "weights, so only changes that keep every parameter shape are possible "
                         "(RoPE settings, windows, kernels, ...)")
