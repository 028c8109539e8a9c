"""Staged training recipes (report 3.1-3.2, 4.2): an ordered list of stages, each a training run
that starts from the previous stage's weights.

    python -m train --recipe configs/recipes/tiny_staged.yaml --workdir runs/staged

Recipe file (YAML):

    base: configs/tiny.yaml
    overrides: ["train.warmup_steps=10"]          # every stage, first
    stages:
      - name: pretrain
        overrides: ["train.steps=200", "train.seq_len=128"]
      - name: long-context
        overrides: ["train.seq_len=256", "model.full_attention.rope_theta=40000",
                    "train.freeze_router=true", "train.balance_loss_coef=0.0"]
      - name: mtp
        clone_mtp: true                            # MTP-2..n start as copies of MTP-1
        overrides: ["train.mtp_offset_weights=[1.0, 1.0, 1.0]"]

A stage overrides anything of the run config: schedule (`train.steps`, `train.lr`,
`train.schedule`, ...), sequence length, RoPE theta of the full layers, the data mixture
(`train.data.source`), router freezing, the balance-loss coefficient, MTP weights, the meta-token
loss switch (`train.data.meta_loss_mask_after_tokens=0` masks metadata for the whole stage).
Overrides given on the command line apply to every stage, last.

Stage k trains in DIR/stages/<kk>-<name> like a `python -m train` run. The first stage starts
from random weights, or from `--init-from SRC` (train/init_from.py). Stage k starts from the final
params and router biases of stage k-1 with a new optimizer state and its own learning-rate
schedule from step 0 (optimizer groups change between stages: frozen routers, newly trained MTP
heads), and reads data with `train.seed + k` so it does not replay the previous stage's order.
Re-running the command skips finished stages and resumes the unfinished one from its checkpoint.
Only shape-preserving model changes are possible between stages.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Sequence

import jax

from model.config import ModelConfig
from model.interop.workdir import latest_checkpoint_step
from model.interop.workdir_lock import workdir_lock
from model.tokenizers.text import load_tokenizer
from model.weights import load_model
from train.checkpoint import changed_since_checkpoint
from train.config import RunConfig, load_run_config
from train.data.sources import check_data, open_data
from train.experiments.spec import override_list, read_spec
from train.init_from import model_changes
from train.loop import TrainingError, TrainSummary, train

RECIPE_KEYS = ("stages",)  # besides spec.COMMON_KEYS
STAGE_KEYS = ("name", "overrides", "clone_mtp")


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    overrides: tuple[str, ...]
    clone_mtp: bool = False  # at the start of the stage, every MTP head becomes a copy of MTP-1


@dataclasses.dataclass(frozen=True)
class Recipe:
    base: Path
    overrides: tuple[str, ...]
    stages: tuple[Stage, ...]
    description: str = ""

    def stage_config(self, index: int, extra: Sequence[str] = ()) -> RunConfig:
        """Run config of stage `index` (0-based): base, recipe overrides, the stage's, `extra`;
        the data seed is offset by the stage index; only the first stage keeps
        `train.init_from`."""
        run = load_run_config(self.base, [*self.overrides, *self.stages[index].overrides, *extra])
        # A later stage starts from the previous one's weights, whatever `train.init_from` says
        return dataclasses.replace(run, train=dataclasses.replace(
            run.train, seed=run.train.seed + index,
            init_from=run.train.init_from if index == 0 else ""))

    def stage_dir(self, workdir: Path, index: int) -> Path:
        return Path(workdir) / "stages" / f"{index + 1:02d}-{self.stages[index].name}"


def load_recipe(path: str | Path, extra: Sequence[str] = ()) -> Recipe:
    """Reads and checks a recipe file; every stage's config (with the command line's `extra`
    overrides) is resolved here, so a mistake in a late stage fails before the first trains."""
    spec = read_spec(path, "recipe", RECIPE_KEYS)
    entries = spec.values.get("stages")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"recipe {spec.path}: 'stages' must be a non-empty list")
    stages = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "name" not in entry or set(entry) - set(STAGE_KEYS):
            raise ValueError(f"recipe stages[{i}]: expected {{name, overrides, clone_mtp}}, "
                             f"got {entry!r}")
        name = str(entry["name"])
        if not name or any(c in name for c in "/\\") or name.startswith("."):
            raise ValueError(f"recipe stages[{i}].name: {name!r} is not a usable directory name")
        clone = entry.get("clone_mtp", False)
        if not isinstance(clone, bool):
            raise ValueError(f"recipe stages[{i}].clone_mtp: expected true or false, got {clone!r}")
        if clone and i == 0:
            raise ValueError("recipe stages[0].clone_mtp: the first stage has no MTP-1 to clone")
        overrides = override_list(entry.get("overrides"), f"recipe stages[{i}].overrides")
        stages.append(Stage(name, overrides, clone))
    recipe = Recipe(spec.base, spec.overrides, tuple(stages), spec.description)
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


def clone_mtp_heads(params: dict) -> dict:
    """Params with every MTP head `mtp_h` (h >= 1) replaced by a copy of `mtp_0` (MTP-1)."""
    heads = sorted(k for k in params if k.startswith("mtp_") and k[4:].isdigit())
    return {**params, **{k: jax.tree.map(lambda x: x.copy(), params["mtp_0"])
                         for k in heads if k != "mtp_0"}}


def stage_start_variables(recipe: Recipe, workdir: Path, index: int) -> dict | None:
    """Variables {"params", "balance"} stage `index` starts from: the previous stage's final
    checkpoint (MTP heads cloned if the stage says so); None for the first stage."""
    if index == 0:
        return None
    _, variables = load_model(recipe.stage_dir(workdir, index - 1))
    if recipe.stages[index].clone_mtp:
        variables = {**variables, "params": clone_mtp_heads(variables["params"])}
    return variables


@dataclasses.dataclass
class RecipeOutcome:
    summaries: dict[str, TrainSummary]  # stage name -> summary of the stages this call trained
    skipped: list[str]  # stages already finished
    interrupted: bool


def run_recipe(recipe: Recipe, workdir: Path, extra: Sequence[str] = (), *,
               stop_after: int | None = None, log: Callable[[str], None] = print,
               allow_data_change: bool = False) -> RecipeOutcome:
    """Trains the stages in order, skipping finished ones and resuming the unfinished one.
    `stop_after`: leave after this many steps of this invocation (over stages), as a SIGTERM
    would; used to test resumption. `allow_data_change`: as `train`'s. Every stage's data
    splits are checked first, so a late stage's bad data fails before the first trains."""
    workdir = Path(workdir)
    check_stage_data(recipe, extra)
    workdir.mkdir(parents=True, exist_ok=True)
    with workdir_lock(workdir):  # each stage's `train` locks its own directory too
        return _run_stages(recipe, workdir, extra, stop_after, log, allow_data_change)


def check_stage_data(recipe: Recipe, extra: Sequence[str] = ()) -> None:
    """`train.data.sources.check_data` for every stage (each stage's data opened once)."""
    opened = {}
    for index, stage in enumerate(recipe.stages):
        run = recipe.stage_config(index, extra)
        data = run.train.data
        key = (data.source, tuple(data.mixture.items()), data.tokenizer, data.heldout_fraction)
        try:
            tokenizer = load_tokenizer(data.tokenizer)
            opened[key] = opened.get(key) or open_data(data, tokenizer)
            check_data(opened[key], data, tokenizer, loss_mask=run.train.loss_mask,
                       heldout=run.train.eval_every > 0, shard_count=jax.process_count())
        except ValueError as err:
            raise ValueError(f"recipe stage {stage.name}: {err}") from None


def _run_stages(recipe: Recipe, workdir: Path, extra: Sequence[str], stop_after: int | None,
                log: Callable[[str], None], allow_data_change: bool) -> RecipeOutcome:
    (workdir / "recipe.json").write_text(json.dumps({
        "base": str(recipe.base), "overrides": [*recipe.overrides, *extra],
        "stages": [dataclasses.asdict(s) for s in recipe.stages]}, indent=2) + "\n")
    outcome = RecipeOutcome({}, [], False)
    budget = stop_after
    for index, stage in enumerate(recipe.stages):
        run, stage_dir = recipe.stage_config(index, extra), recipe.stage_dir(workdir, index)
        label = f"[stage {index + 1}/{len(recipe.stages)}] {stage.name}"
        done = latest_checkpoint_step(stage_dir)
        if done is not None and done >= run.train.steps:
            _check_unchanged(stage_dir, run, stage.name)
            log(f"{label}: finished (step {done}), skipped")
            outcome.skipped.append(stage.name)
            continue
        if budget is not None and budget <= 0:
            outcome.interrupted = True
            break
        start = None
        if done is not None:
            log(f"{label}: resuming at step {done}")
        elif index == 0:
            log(f"{label}: training -> {stage_dir}")
        else:
            start = stage_start_variables(recipe, workdir, index)
            log(f"{label}: starting from {recipe.stage_dir(workdir, index - 1)}"
                + (" with MTP-1 cloned into every MTP head" if stage.clone_mtp else ""))
        summary = train(run, stage_dir, stop_after=budget, start_from=start,
                        allow_data_change=allow_data_change)
        outcome.summaries[stage.name] = summary
        if summary.interrupted:
            outcome.interrupted = True
            break
        if budget is not None:
            budget -= summary.last_step - summary.first_step
    return outcome


def _check_unchanged(stage_dir: Path, run: RunConfig, name: str) -> None:
    """A finished stage whose recipe entry changed since would silently feed stale weights to
    the next stage: refuse instead."""
    changed = changed_since_checkpoint(stage_dir, run.to_dict())
    if changed:
        raise TrainingError(f"stage {name} in {stage_dir} finished with a different config "
                            f"({', '.join(changed)}); restore the recipe or use another --workdir")
