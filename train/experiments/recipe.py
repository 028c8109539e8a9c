"""Staged training recipes (report 3.1-3.2, 4.2): an ordered list of stages, each a training run
that continues the stages before it.

    python -m train --recipe configs/recipes/tiny_staged.yaml --workdir runs/staged

Recipe file (YAML; recipe_file.py reads it):

    base: configs/tiny.yaml
    overrides: ["train.warmup_steps=10"]          # every stage, first
    stages:
      - name: pretrain                             # letters, digits, '.', '_', '-'
        overrides: ["train.steps=200", "train.seq_len=128"]
      - name: long-context
        overrides: ["train.seq_len=256", "model.full_attention.rope_theta=40000",
                    "train.freeze_router=true", "train.balance_loss_coef=0.0"]
      - name: mtp
        clone_mtp: true                            # MTP-2..n start as copies of MTP-1
        reset_optimizer: false                     # (default) carry the optimizer state on
        overrides: ["train.mtp_offset_weights=[1.0, 1.0, 1.0]"]

A stage overrides anything of the run config: schedule (`train.steps`, `train.lr`,
`train.schedule`, ...), sequence length, RoPE theta of the full layers, the data mixture
(`train.data.source`), router freezing, the balance-loss coefficient, MTP weights, the meta-token
loss switch (`train.data.meta_loss_mask_after_tokens=0` masks metadata for the whole stage).
Overrides given on the command line apply to every stage, last. A recipe may also give one
learning-rate schedule that the stages share, each training its slice (`schedule:`, see
recipe_file.py), as one run's decay would cross a stage boundary.

Stage k trains in DIR/stages/<kk>-<name> like a `python -m train` run. The first stage starts
from random weights, or from `--init-from SRC` (train/init_from.py). Stage k starts from the
final params and router biases of stage k-1, and its optimizer state (Muon's momentum, Adam's moments)
continues those of the stages before it entry by entry (optimizer_carry.py: what a change of
optimizer groups, e.g. a frozen router or a newly trained MTP head, leaves new is said in the
output); `reset_optimizer: true` starts it new. Its data is read with `train.seed + k`, so it
does not replay the previous stage's order. Re-running the command skips finished stages and
resumes the unfinished one from its checkpoint; a trained stage whose start point changed since
(an earlier stage trained on, or again) is refused with the stages to move away
(stage_start.py). Only shape-preserving model changes are possible between stages.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Callable, Sequence

import jax
from jax.sharding import Mesh

from model.interop.workdir import latest_checkpoint_step
from model.interop.workdir_lock import workdir_lock
from model.tokenizers.text import load_tokenizer
from model.weights import load_model
from train.checkpoint import changed_since_checkpoint
from train.config import RunConfig
from train.data.sources import check_data, open_data
from train.experiments.optimizer_carry import optimizer_carry
# A recipe's entry points, here both: load_recipe (the file) and run_recipe.
from train.experiments.recipe_file import Recipe, load_recipe  # noqa: F401
from train.experiments.stage_start import check_descent, checkpoint_identity, record_start
from train.loop import TrainingError, TrainSummary, train
from train.parallel.distributed import is_lead
from train.periodic_config import reads_heldout


def clone_mtp_heads(params: dict) -> dict:
    """Params with every MTP head `mtp_h` (h >= 1) replaced by a copy of `mtp_0` (MTP-1)."""
    heads = sorted(k for k in params if k.startswith("mtp_") and k[4:].isdigit())
    return {**params, **{k: jax.tree.map(lambda x: x.copy(), params["mtp_0"])
                         for k in heads if k != "mtp_0"}}


def stage_start_variables(recipe: Recipe, workdir: Path, index: int,
                          mesh: Mesh | None = None) -> dict | None:
    """Variables {"params", "balance"} stage `index` starts from: the previous stage's final
    checkpoint (MTP heads cloned if the stage says so), read onto `mesh` as `train.init_from`'s
    weights are; None for the first stage."""
    if index == 0:
        return None
    _, variables = load_model(recipe.stage_dir(workdir, index - 1), mesh)
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
    splits are checked first, so a late stage's bad data fails before the first trains, and
    every trained stage's start point (stage_start.py) before anything is written."""
    workdir = Path(workdir)
    check_stage_data(recipe, extra)
    workdir.mkdir(parents=True, exist_ok=True)
    with workdir_lock(workdir):  # each stage's `train` locks its own directory too
        stages = [(s.name, recipe.stage_dir(workdir, i), recipe.stage_config(i, extra).train.steps)
                  for i, s in enumerate(recipe.stages)]
        try:
            check_descent(stages, log, write=is_lead())
        except ValueError as err:
            raise TrainingError(str(err)) from None
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
                       heldout=reads_heldout(run.train), shard_count=jax.process_count())
        except ValueError as err:
            raise ValueError(f"recipe stage {stage.name}: {err}") from None


def _run_stages(recipe: Recipe, workdir: Path, extra: Sequence[str], stop_after: int | None,
                log: Callable[[str], None], allow_data_change: bool) -> RecipeOutcome:
    if is_lead():
        (workdir / "recipe.json").write_text(json.dumps({
            "base": str(recipe.base), "overrides": [*recipe.overrides, *extra],
            "schedule": list(recipe.schedule),
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
        start = carry = None
        if done is not None:
            log(f"{label}: resuming at step {done}")
        elif index == 0:
            log(f"{label}: training -> {stage_dir}")
        else:
            start, carry = _stage_start(recipe, workdir, index, label, log)
        summary = train(run, stage_dir, stop_after=budget, start_from=start, carry=carry,
                        allow_data_change=allow_data_change)
        outcome.summaries[stage.name] = summary
        if summary.interrupted:
            outcome.interrupted = True
            break
        if budget is not None:
            budget -= summary.last_step - summary.first_step
    return outcome


def _stage_start(recipe: Recipe, workdir: Path, index: int, label: str,
                 log: Callable[[str], None]):
    """(its start variables given the mesh, optimizer carry) of stage `index` starting now;
    records its start point (stage_start.py)."""
    stage, before = recipe.stages[index], recipe.stage_dir(workdir, index - 1)
    if is_lead():
        record_start(recipe.stage_dir(workdir, index), recipe.stages[index - 1].name,
                     checkpoint_identity(before))
    log(f"{label}: starting from {before}"
        + (" with MTP-1 cloned into every MTP head" if stage.clone_mtp else ""))
    if stage.reset_optimizer:
        log(f"{label}: optimizer state new (reset_optimizer: true)")
        carry = None
    else:
        sources = [(recipe.stages[i].name, recipe.stage_dir(workdir, i))
                   for i in range(index - 1, -1, -1)]
        carry = optimizer_carry(sources, lambda line: log(f"{label}: {line}"))
    return functools.partial(stage_start_variables, recipe, workdir, index), carry


def _check_unchanged(stage_dir: Path, run: RunConfig, name: str) -> None:
    """A finished stage whose recipe entry changed since would silently feed stale weights to
    the next stage: refuse instead."""
    changed = changed_since_checkpoint(stage_dir, run)
    if changed:
        raise TrainingError(f"stage {name} in {stage_dir} finished with a different config "
                            f"({', '.join(changed)}); restore the recipe or use another --workdir")
