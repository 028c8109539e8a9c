"""What a recipe stage starts from (train/experiments/stage_start.py, optimizer_carry.py): the
record of the checkpoint a stage started from and the refusal of stages whose start point has
changed since; the optimizer state carried entry by entry from earlier stages' checkpoints
(saved here from random states of the small model, nothing trained)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from train_helpers import small_run

from model.interop.workdir import Checkpointer
from train.experiments import stage_start
from train.experiments.optimizer_carry import carried_entries, describe, entry_key
from train.experiments.stage_start import START_FILE, check_descent, checkpoint_identity
from train.state import abstract_state, build_training

# ---- start records and stale stages -------------------------------------------------------------


def fake_stage(root: Path, name: str, step: int | None, config: dict | None = None) -> Path:
    """A stage directory whose newest checkpoint is `step` (None: no checkpoint)."""
    stage = root / name
    stage.mkdir()
    if step is not None:
        (stage / "checkpoints" / str(step)).mkdir(parents=True)
        (stage / "checkpoints" / str(step) / "_CHECKPOINT_METADATA").write_text("saved at t0")
        (stage / "config.json").write_text(json.dumps(config or {"train": {"steps": step}}))
    return stage


@pytest.fixture
def stages(tmp_path, monkeypatch):
    """Two fake stages, `01-pre` at step 4 and `02-post` trained from it (its record)."""
    monkeypatch.setattr(stage_start, "latest_run_config", lambda d: (
        max(int(p.name) for p in (Path(d) / "checkpoints").iterdir()),
        json.loads((Path(d) / "config.json").read_text())))
    pre = fake_stage(tmp_path, "01-pre", 4)
    post = fake_stage(tmp_path, "02-post", 3)
    stage_start.record_start(post, "pre", checkpoint_identity(pre))
    return pre, post


def refusal(listed, log=print) -> str:
    with pytest.raises(ValueError) as err:
        check_descent(listed, log, write=True)
    return str(err.value)


def test_a_stage_still_descending_from_its_start_passes(stages):
    pre, post = stages
    check_descent([("pre", pre, 4), ("post", post, 3)], print, write=True)
    check_descent([("pre", pre, 3), ("post", post, 3)], print, write=True)  # steps lowered


def test_a_stage_whose_start_trains_on_is_refused_naming_what_to_move(stages):
    """The issue's case: stage 1's train.steps raised from 4 to 6 after stage 2 trained."""
    pre, post = stages
    message = refusal([("pre", pre, 6), ("post", post, 3)])
    assert message.startswith(f"recipe: stage post ({post}) starts from stage pre: it was "
                              "trained from its step 4, but pre will train on from step 4 to 6")
    assert f"move them away (mv {post} {post}.old)" in message and "\n" not in message


def test_a_stage_whose_start_was_replaced_is_refused(stages):
    pre, post = stages
    (pre / "checkpoints" / "4" / "_CHECKPOINT_METADATA").write_text("saved at t1")
    assert "pre has been trained again since" in refusal([("pre", pre, 4), ("post", post, 3)])
    (pre / "checkpoints" / "5").mkdir()
    assert "pre now ends at step 5" in refusal([("pre", pre, 4), ("post", post, 3)])
    for path in sorted((pre / "checkpoints").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    (pre / "checkpoints").rmdir()
    assert "pre has no checkpoint any more" in refusal([("pre", pre, 4), ("post", post, 3)])


def test_every_later_stage_is_listed_and_nothing_is_written(stages, tmp_path):
    pre, post = stages
    last = fake_stage(tmp_path, "03-last", 2)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    message = refusal([("pre", pre, 6), ("post", post, 3), ("last", last, 2)])
    assert f"mv {post} {post}.old; mv {last} {last}.old" in message
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_stage_without_a_start_record_is_noted_and_recorded(stages):
    pre, post = stages
    (post / START_FILE).unlink()
    notes = []
    check_descent([("pre", pre, 4), ("post", post, 3)], notes.append, write=True)
    assert len(notes) == 1 and "post has no record of the checkpoint it started from" in notes[0]
    assert json.loads((post / START_FILE).read_text())["step"] == 4
    assert refusal([("pre", pre, 6), ("post", post, 3)])  # and checked from then on


# ---- the optimizer state carried ---------------------------------------------------------------


def saved_stage(root: Path, name: str, run, seed: int) -> tuple[Path, object]:
    """A stage directory holding a random state of `run` at step 3 -> (it, that state)."""
    abstract = abstract_state(build_training(run), 0)
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype)
                         if a.dtype.kind == "f" else np.full(a.shape, seed, a.dtype), abstract)
    checkpoints = Checkpointer(root / name / "checkpoints", 3)
    checkpoints.save(3, state, {}, run.to_dict())
    checkpoints.close()
    return root / name, state


def entries(opt_state) -> dict[tuple, np.ndarray]:
    return {entry_key(path): np.asarray(x)
            for path, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]}


def carry(run, sources):
    abstract = abstract_state(build_training(run), 0).opt_state
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    found, taken, new = carried_entries(abstract, jax.tree.map(lambda _: device, abstract),
                                        sources)
    keys = [entry_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    return {keys[i]: np.asarray(x) for i, x in found.items()}, taken, new, len(keys)


def test_matching_optimizer_groups_carry_every_entry_but_the_schedule_count(tmp_path):
    run = small_run()
    pre, state = saved_stage(tmp_path, "pre", run, seed=1)
    found, taken, new, total = carry(run, [("pre", pre)])
    saved = entries(state.opt_state)
    counts = [k for k in saved if k[-1] == "count" and k[-2] == 2]  # ScaleByScheduleState
    assert len(counts) == 2 and new == [] and taken == {"pre": total - 2}
    assert sorted(found) == sorted(k for k in saved if k not in counts)
    for key, value in found.items():
        np.testing.assert_array_equal(value, saved[key])
    assert describe(taken, new, total - 2).startswith(f"optimizer state carried: {total - 2} of ")


def test_entries_missing_from_the_previous_stage_come_from_an_earlier_one(tmp_path):
    """Stage b froze the router (its Muon momentum absent there); stage c trains it again and
    finds it in stage a, everything else in b. A head no stage trained starts new."""
    a, state_a = saved_stage(tmp_path, "a", small_run(), seed=1)
    b, state_b = saved_stage(tmp_path, "b", small_run("train.freeze_router=true"), seed=2)
    found, taken, new, _ = carry(small_run("train.mtp_offset_weights=[1.0, 1.0]"),
                                 [("b", b), ("a", a)])
    from_a, from_b = entries(state_a.opt_state), entries(state_b.opt_state)
    routers = [k for k in found if k[-1] == "router"]
    assert routers and all(k not in from_b for k in routers)
    for key, value in found.items():
        np.testing.assert_array_equal(value, from_b[key] if key in from_b else from_a[key])
    assert taken == {"b": len(found) - len(routers), "a": len(routers)}
    assert new and all("mtp_1" in k for k in new)  # MTP-2 trains for the first time
    line = describe(taken, new, 99, {"mtp_0", "mtp_1", "layers"})
    assert line.endswith(f"; {len(new)} new, of mtp_1 ({len(new)}): no earlier stage trained "
                         "them in this optimizer group and shape")


def test_another_optimizer_carries_nothing_of_the_other(tmp_path):
    muon, _ = saved_stage(tmp_path, "muon", small_run(), seed=1)
    found, taken, new, _ = carry(small_run("train.optimizer=adamw"), [("muon", muon)])
    assert all(k[1] == "adamw" for k in found)  # Adam's moments of the 1-D params, its count
    assert new and all(k[1] == "adamw" and k[-1] != "count" for k in new)  # ex-Muon matrices
