"""A recipe stage's optimizer state carried over from the stages before it
(train/experiments/recipe.py), where the report trains one run whose optimizer never restarts.

The state is carried entry by entry. An entry of the new stage's state (one param's Muon
momentum, or Adam's first moment of it, or Adam's step count) takes the value that the latest
earlier stage with that entry saved in its final checkpoint: the same param in the same
optimizer group, with the same shape. So a stage whose groups match the previous stage's
continues it whole; a stage that trains only some params (DeepSeek-V4's indexer warm-up) carries
theirs, and the stage after it finds the other params' moments one stage further back (they did
not move in between, as their params did not). An entry that no earlier stage saved starts new:
a param that trains for the first time (an MTP head cloned at this stage), or one that moved to
another group (the optimizer changed from AdamW to Muon). The learning-rate schedule's count is
never carried: a stage counts its steps from 0 and `train.schedule_offset` places them in a
schedule shared by the stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import optax

from model.interop.workdir import Checkpointer, latest_run_config
from train.config import run_config_from_dict
from train.state import abstract_state, build_training


def entry_key(path: tuple) -> tuple:
    """An optimizer-state leaf's path within the optimizer's groups: the chain position before
    them left out (it moves when a stage adds a frozen group)."""
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path[1:])


def _schedule_counts(opt_state: Any) -> set[tuple]:
    """Keys of the learning-rate schedules' counts (optax.ScaleByScheduleState)."""
    nodes = jax.tree_util.tree_flatten_with_path(
        opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))[0]
    return {entry_key((*path, jax.tree_util.GetAttrKey("count"))) for path, node in nodes
            if isinstance(node, optax.ScaleByScheduleState)}


def carried_entries(abstract: Any, shardings: Any, sources: Sequence[tuple[str, Path]]
                    ) -> tuple[dict[int, jax.Array], dict[str, int], list[tuple]]:
    """The entries of the optimizer state `abstract` (ShapeDtypeStructs; `shardings` lines up)
    found in the final checkpoints of `sources` ((stage name, stage dir), newest first).
    -> ({leaf index: array restored in its sharding}, {stage name: entries taken from it},
    keys of the entries found nowhere)."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    targets = jax.tree.leaves(shardings)
    counts = _schedule_counts(abstract)
    missing = {entry_key(path): i for i, (path, _) in enumerate(leaves)
               if entry_key(path) not in counts}
    found: dict[int, jax.Array] = {}
    taken: dict[str, int] = {}
    for name, stage_dir in sources:
        if not missing:
            break
        if not (Path(stage_dir) / "checkpoints").is_dir():  # moved away: nothing to carry
            continue
        step, saved_config = latest_run_config(stage_dir)
        saved = abstract_state(build_training(run_config_from_dict(saved_config)), 0).opt_state

        def wanted(path, leaf):
            i = missing.get(entry_key(path))
            if i is None or (leaf.shape, leaf.dtype) != (leaves[i][1].shape, leaves[i][1].dtype):
                return None
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=targets[i])

        target = jax.tree_util.tree_map_with_path(wanted, saved)
        if not jax.tree.leaves(target):
            continue
        checkpoints = Checkpointer(Path(stage_dir) / "checkpoints", keep=1 << 30)
        try:
            restored = checkpoints.restore_subset(step, {"opt_state": target})["opt_state"]
        finally:
            checkpoints.close()
        for path, value in jax.tree_util.tree_flatten_with_path(restored)[0]:
            found[missing.pop(entry_key(path))] = value
            taken[name] = taken.get(name, 0) + 1
    return found, taken, sorted(missing, key=str)


def describe(taken: dict[str, int], new: list[tuple], total: int, roots=()) -> str:
    """One line on what a stage's optimizer state carried and what starts new, and why; the
    new entries are counted by the top-level param (of `roots`) they belong to."""
    if not taken:
        return (f"optimizer state new: none of its {total} entries is in an earlier stage's "
                "(no param trained there in the same optimizer group and shape)")
    sources = (next(iter(taken)) if len(taken) == 1 else
               " and ".join(f"{name} ({n})" for name, n in taken.items()))
    line = f"optimizer state carried: {sum(taken.values())} of {total} entries from {sources}"
    if new:
        owners: dict[str, int] = {}
        for key in new:
            owner = next((str(k) for k in key if k in roots), ".".join(map(str, key)))
            owners[owner] = owners.get(owner, 0) + 1
        shown = ", ".join(f"{owner} ({n})" for owner, n in list(owners.items())[:3])
        line += (f"; {len(new)} new, of {shown}{', ...' if len(owners) > 3 else ''}: no earlier "
                 "stage trained them in this optimizer group and shape")
    return line


def optimizer_carry(sources: Sequence[tuple[str, Path]], log: Callable[[str], None]
                    ) -> Callable[[Any], dict[int, jax.Array]]:
    """`train.loop.train`'s `carry`: given the stage's Trainer, the entries of its optimizer
    state carried from `sources` ((stage name, stage dir), newest first), logged."""
    def carry(trainer) -> dict[int, jax.Array]:
        abstract = trainer.abstract_state.opt_state
        found, taken, new = carried_entries(abstract, trainer.state_sharding.opt_state, sources)
        total = len(jax.tree.leaves(abstract)) - len(_schedule_counts(abstract))
        log(describe(taken, new, total, set(trainer.abstract_state.params)))
        return found
    return carry
