"""Tests of staged recipes (`train.experiments.recipe`, `python -m train --recipe`): the recipe
file, MTP cloning, and one real two-stage recipe (frozen router across a stage, MTP-2 equal to MTP-1
at the clone point, resumption mid-recipe in the right stage)."""

from __future__ import annotations

import functools
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
import yaml
from train_helpers import SMALL_LOOP, TINY

from model.weights import load_model
from train.__main__ import main as train_main
from train.experiments.recipe import clone_mtp_heads, load_recipe, run_recipe, stage_start_variables
from train.optim.schedules import learning_rate_schedule
from train.parallel.sharding import make_mesh
from train.step import mtp_weight_at


def write_recipe(tmp_path: Path, stages, **values) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"base": str(TINY), "overrides": SMALL_LOOP, "stages": stages,
                                    **values}))
    return path


def leaves_named(params, name: str) -> list[np.ndarray]:
    return [np.asarray(x) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
            if any(getattr(k, "key", None) == name for k in path)]


@functools.lru_cache
def shipped_recipe(name: str):
    """A recipe of configs/recipes/, loaded once (the full-size ones trace their models)."""
    return load_recipe(Path(__file__).resolve().parents[2] / "configs" / "recipes" / f"{name}.yaml")


# ---- the recipe file ---------------------------------------------------------------------------


def test_stages_layer_their_overrides_and_offset_the_seed(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, [
        {"name": "short", "overrides": ["train.steps=2", "train.seq_len=8"]},
        {"name": "long", "overrides": ["train.steps=3",
                                       "model.full_attention.rope_theta=50000.0"]},
    ]), ["train.lr=0.01"])
    first, second = recipe.stage_config(0, ["train.lr=0.01"]), recipe.stage_config(1, ["train.lr=0.01"])
    assert (first.train.steps, first.train.seq_len, second.train.seq_len) == (2, 8, 16)
    assert (first.model.full_attention.rope_theta,
            second.model.full_attention.rope_theta) == (10000.0, 50000.0)
    assert second.model.swa_attention.rope_theta == 10000.0
    assert first.train.lr == second.train.lr == 0.01
    assert second.train.seed == first.train.seed + 1
    assert recipe.stage_dir(tmp_path, 1) == tmp_path / "stages" / "02-long"


def test_shipped_recipe_loads():
    root = Path(__file__).resolve().parents[2]
    recipe = load_recipe(root / "configs" / "recipes" / "tiny_staged.yaml")
    runs = [recipe.stage_config(i) for i in range(len(recipe.stages))]
    assert [s.name for s in recipe.stages] == ["pretrain", "anneal", "midtrain", "mtp"]
    assert [r.train.freeze_router for r in runs] == [False, False, True, True]
    assert [s.clone_mtp for s in recipe.stages] == [False, False, False, True]
    assert runs[-1].trained_mtp_heads() == 3 and runs[0].trained_mtp_heads() == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v4_flash", "tiny_deepseek_v4"])
def test_deepseek_v4_recipes_follow_the_reports_schedule(name):
    """DeepSeek-V4 report 4.2.2: dense attention first (the indexer idle), a short warm-up in
    which only the indexers train with attention still dense, then sparse attention; lengths
    growing by stage; the MTP weight 0.3, then 0.1 from the start of the learning-rate decay;
    V4's optimizer and losses throughout."""
    recipe = shipped_recipe(name)
    runs = [recipe.stage_config(i) for i in range(len(recipe.stages))]
    modes = [r.model.shared_kv_attention.csa_attention for r in runs]
    assert modes == ["dense", "dense", "dense", "sparse", "sparse"]
    assert [r.train.trainable for r in runs] == ["all", "all", "indexer", "all", "all"]
    assert [r.train.indexer_loss_coef for r in runs] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert runs[2].train.router_bias_rate == 0.0
    lengths = [r.train.seq_len for r in runs]
    assert lengths[:3] == sorted(set(lengths[:3])) and lengths[2] == lengths[3] < lengths[4]
    assert runs[0].train.batch_warmup  # the batch ramp
    # MTP weight 0.3 until the decay starts (in the first sparse stage), 0.1 from there on
    weights = [float(mtp_weight_at(r, n)) for r in runs if r.train.trainable == "all"
               for n in (0, r.train.steps - 1)]
    assert weights == pytest.approx([0.3, 0.3, 0.3, 0.3, 0.3, 0.1, 0.1, 0.1])
    for run in runs:
        muon = run.train.muon
        assert (muon.orthogonalizer, muon.steps, muon.update_rms) == (
            "hybrid_newton_schulz", 10, 0.18)
        assert muon.finish_steps in (None, 2) and run.train.adam_eps == 1e-20
        assert (run.train.balance_loss_coef, run.train.sequence_balance_coef) == (0.0, 1e-4)


# (peak lr, final lr, cosine steps, warm-up steps) of DeepSeek-V4's schedule (report 4.2.2:
# warm-up over 2,000 steps, 2.7e-4 held, one cosine to 2.7e-5 near the end; the recipe chooses
# the last 42,600 steps, 3.2T tokens) and of its CPU-size copy.
V4_SCHEDULES = {"deepseek_v4_flash": (2.7e-4, 2.7e-5, 42600, 2000),
                "tiny_deepseek_v4": (3e-3, 3e-4, 40, 10)}


@pytest.mark.parametrize("name", sorted(V4_SCHEDULES))
def test_deepseek_v4_stages_run_one_learning_rate_schedule(name):
    """The main model's stages each take their slice of one schedule: their per-step learning
    rates, concatenated, are the single schedule's and follow the report's shape in float64
    (linear warm-up, peak held, one cosine that crosses the last stage boundary without a
    kink); the indexer warm-up keeps its own rate and does not move the schedule on."""
    recipe = shipped_recipe(name)
    stages = [recipe.stage_config(i).train for i in range(len(recipe.stages))]
    shared = [t for t in stages if t.trainable == "all"]
    rates = np.concatenate([np.asarray(learning_rate_schedule(**t.schedule_settings())(
        np.arange(t.steps))) for t in shared])
    whole = recipe.schedule_config().train
    np.testing.assert_array_equal(rates, learning_rate_schedule(**whole.schedule_settings())(
        np.arange(whole.steps)))
    peak, final, decay, warmup = V4_SCHEDULES[name]
    step = np.arange(len(rates), dtype=np.float64)
    start = len(rates) - decay
    expected = np.where(step < warmup, peak * step / warmup, peak)
    cosine = final + (peak - final) * 0.5 * (1 + np.cos(np.pi * (step - start) / decay))
    expected = np.where(step >= start, cosine, expected)
    np.testing.assert_allclose(rates, expected, rtol=2e-6, atol=1e-6 * peak)  # float32
    assert len(rates) - shared[-1].steps > start  # the decay crosses into the last stage
    warm_up_stage = stages[[t.trainable for t in stages].index("indexer")]
    assert (warm_up_stage.schedule, warm_up_stage.schedule_offset) == ("constant", 0)


@pytest.mark.parametrize("name", ["mimo_v2_flash", "tiny_mimo"])
def test_mimo_recipes_follow_the_reports_schedule(name):
    """MiMo-V2-Flash's report: AdamW, sequence auxiliary loss 1e-5 and no EP-group loss, MTP
    weight 0.3 in stage 1 and 0.1 after, the full layers' RoPE base raised for the long stage
    with the bias update at 1e-5, one MTP head trained until its clones join at the end."""
    root = Path(__file__).resolve().parents[2]
    recipe = load_recipe(root / "configs" / "recipes" / f"{name}.yaml")
    runs = [recipe.stage_config(i) for i in range(len(recipe.stages))]
    assert all(r.train.optimizer == "adamw" for r in runs)
    assert all((r.train.balance_loss_coef, r.train.sequence_balance_coef) == (0.0, 1e-5)
               for r in runs)
    # One head weighs 0.3, then 0.1; after cloning, 0.1 in all: 0.1 x the heads' mean loss
    totals = [r.train.mtp_loss_weight * sum(r.train.mtp_offset_weights[:r.trained_mtp_heads()])
              for r in runs]
    assert totals == pytest.approx([0.3, 0.1, 0.1, 0.1], rel=1e-12)
    assert runs[-1].train.mtp_offset_weights == pytest.approx([1 / 3] * 3, rel=1e-12)
    assert [r.model.full_attention.rope_theta for r in runs] == [640000.0, 640000.0, 5e6, 5e6]
    assert runs[2].train.seq_len > runs[1].train.seq_len
    assert [r.train.router_bias_rate for r in runs] == [1e-3, 1e-3, 1e-5, 1e-5]
    assert [s.clone_mtp for s in recipe.stages] == [False, False, False, True]
    assert [r.trained_mtp_heads() for r in runs] == [1, 1, 1, 3]


@pytest.mark.parametrize("stages, needle", [
    ([{"name": "a", "clone_mtp": True}], "the first stage has no MTP-1 to clone"),
    ([{"name": "a"}, {"name": "b", "clone_mtp": True, "overrides": ["model.mtp.num_heads=1"]}],
     "clone_mtp needs model.mtp.num_heads >= 2"),
    ([{"name": "a", "freeze": True}], "stages[0]: expected a mapping of name, overrides, "),
    ([{"name": "a/b"}], "not a usable directory name"),
    # names become directory names: refused before anything is written (see the next test)
    ([{"name": "a\x00b"}], "stages[0].name: 'a\\x00b' is not a usable directory name"),
    ([{"name": "x" * 300}], f"stages[0].name: {'x' * 80!r} is not a usable directory name"),
    ([{"name": ".hidden"}], "not a usable directory name"),
    ([{"name": "a"}, {"name": "a"}], "stage name 'a' is given twice"),
    ([{"name": "a", "own_schedule": True}], "stages[0].own_schedule: the recipe has no shared"),
    ([{"name": "a", "reset_optimizer": "yes"}], "stages[0].reset_optimizer: expected true or"),
    ([{"name": "a"}, {"name": "late", "overrides": ["train.lr=-1"]}], "recipe stage late:"),
    ([], "'stages' must be a non-empty list"),
])
def test_bad_recipes_name_the_problem(tmp_path, stages, needle):
    with pytest.raises(ValueError) as err:
        load_recipe(write_recipe(tmp_path, stages))
    assert needle in str(err.value)


SCHEDULE = ["train.warmup_steps=2", "train.schedule=stages",
            "train.lr_stages=[[3, 0.003, constant], [5, 0.0003, cosine]]"]


@pytest.mark.parametrize("schedule, stages, needle", [
    (SCHEDULE, [{"name": "a", "overrides": ["train.steps=4", "train.lr=0.1"]},
                {"name": "b", "overrides": ["train.steps=6"]}],
     "recipe stage a: 'train.lr=0.1' sets the recipe's shared schedule; set it in `schedule`, "
     "or give the stage `own_schedule: true`"),
    (SCHEDULE[1:], [{"name": "a"}], "schedule: give train.warmup_steps"),
    (["train.warmup_steps=2", "train.seq_len=8"], [{"name": "a"}],
     "schedule: train.seq_len is not a schedule field"),
    (SCHEDULE, [{"name": "a", "overrides": ["train.steps=4"]},
                {"name": "b", "overrides": ["train.steps=5"]}],
     "recipe schedule (over the stages that follow it: a 4 + b 5 = 9 steps): train.lr_stages: "
     "train.warmup_steps=2 + the stages' 3 + 5 = 10 steps, but train.steps=9"),
    (SCHEDULE, [{"name": "a", "own_schedule": True}], "every stage has `own_schedule: true`"),
])
def test_bad_shared_schedules_name_the_problem(tmp_path, schedule, stages, needle):
    with pytest.raises(ValueError) as err:
        load_recipe(write_recipe(tmp_path, stages, schedule=schedule))
    assert needle in str(err.value)


def test_a_bad_stage_name_writes_nothing(tmp_path, capsys):
    path = write_recipe(tmp_path, [{"name": "ok"}, {"name": "x" * 300}])
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--recipe", str(path), "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "stages[1].name" in err and err.count("\n") == 1
    assert not (tmp_path / "w").exists()


def test_stages_sharing_a_schedule_take_their_slices(tmp_path):
    """Each stage following the recipe's schedule trains its slice of it: offsets by the steps
    of the stages before it that follow it too (an own-schedule stage in between does not
    count), the schedule's length the sum; an own-schedule stage keeps its own settings."""
    recipe = load_recipe(write_recipe(tmp_path, [
        {"name": "a", "overrides": ["train.steps=4"]},
        {"name": "warm", "own_schedule": True, "overrides": ["train.steps=2", "train.lr=0.5",
                                                             "train.schedule=constant"]},
        {"name": "b", "overrides": ["train.steps=6"]},
    ], schedule=["train.lr=0.003", *SCHEDULE]))
    spans = [(t.schedule_offset, t.schedule_steps, t.lr, t.schedule) for t in
             (recipe.stage_config(i).train for i in range(3))]
    assert spans == [(0, 10, 0.003, "stages"), (0, 0, 0.5, "constant"), (4, 10, 0.003, "stages")]
    b = recipe.stage_config(2).train
    whole = recipe.schedule_config().train
    np.testing.assert_array_equal(
        learning_rate_schedule(**b.schedule_settings())(np.arange(6)),
        learning_rate_schedule(**whole.schedule_settings())(np.arange(4, 10)))


def test_recipe_base_is_found_next_to_the_recipe(tmp_path):
    (tmp_path / "run.yaml").write_text(TINY.read_text())
    recipe = load_recipe(write_recipe(tmp_path, [{"name": "a"}], base="run.yaml"))
    assert recipe.base == tmp_path / "run.yaml"
    with pytest.raises(ValueError, match="recipe base: missing.yaml not found"):
        load_recipe(write_recipe(tmp_path, [{"name": "a"}], base="missing.yaml"))


def test_clone_mtp_heads_copies_mtp_1_into_the_others():
    params = {"mtp_0": {"w": np.ones(3)}, "mtp_1": {"w": np.zeros(3)},
              "mtp_2": {"w": np.full(3, 5.0)}, "layers": {"w": np.full(2, 7.0)}}
    cloned = clone_mtp_heads(params)
    for head in ("mtp_0", "mtp_1", "mtp_2"):
        np.testing.assert_array_equal(cloned[head]["w"], np.ones(3))
    np.testing.assert_array_equal(cloned["layers"]["w"], np.full(2, 7.0))
    np.testing.assert_array_equal(params["mtp_1"]["w"], np.zeros(3))  # input untouched


# ---- a real recipe -----------------------------------------------------------------------------


@pytest.mark.slow
def test_recipe_freezes_clones_and_resumes_in_the_right_stage(tmp_path, capsys):
    # Stage 1 has the sweep test's exact settings, so the two share one compiled step.
    path = write_recipe(tmp_path, [
        {"name": "pre"},
        {"name": "mtp", "clone_mtp": True,
         "overrides": ["train.steps=2", "train.freeze_router=true", "train.lr=0.01",
                       "train.mtp_offset_weights=[1.0, 1.0]"]},
    ])
    recipe, workdir = load_recipe(path), tmp_path / "run"
    lines = []
    first = run_recipe(recipe, workdir, stop_after=4, log=lines.append)
    assert first.interrupted and first.skipped == []
    assert {n: (s.first_step, s.last_step) for n, s in first.summaries.items()} == {
        "pre": (0, 3), "mtp": (0, 1)}
    # The optimizer state carries on, but for the MTP-2 that starts training (the frozen
    # router's entries are not in the new state).
    carried = [line for line in lines if "optimizer state" in line]
    assert len(carried) == 1 and carried[0].startswith("[stage 2/2] mtp: optimizer state "
                                                       "carried: ") and "from pre;" in carried[0]
    assert " new, of mtp_1 (" in carried[0] and carried[0].endswith("no earlier stage trained "
                                                                   "them in this optimizer "
                                                                   "group and shape")

    # MTP-2 starts as a copy of the pre-training stage's MTP-1, read onto the stage's mesh.
    _, pre = load_model(recipe.stage_dir(workdir, 0))
    start = stage_start_variables(recipe, workdir, 1)["params"]
    chex.assert_trees_all_equal(pre["params"]["mtp_0"], start["mtp_0"], start["mtp_1"])
    mesh = make_mesh(recipe.stage_config(1).mesh)
    assert {leaf.sharding.mesh for leaf in jax.tree.leaves(
        stage_start_variables(recipe, workdir, 1, mesh))} == {mesh}

    # Re-running skips the finished stage and resumes the second at its checkpoint.
    assert train_main(["--recipe", str(path), "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    assert "[stage 1/2] pre: finished (step 3), skipped" in out
    assert "[stage 2/2] mtp: resuming at step 1" in out
    assert "stage mtp: finished at step 2 (started at 1)" in out
    _, final = load_model(recipe.stage_dir(workdir, 1))

    routers = leaves_named(pre["params"], "router")
    assert routers, "the small model has MoE routers"
    for before, after in zip(routers, leaves_named(final["params"], "router")):
        np.testing.assert_array_equal(before, after)
    moved = [not np.array_equal(a, b) for a, b in zip(
        leaves_named(pre["params"]["layers"], "up_proj"),
        leaves_named(final["params"]["layers"], "up_proj"))]
    assert all(moved), "a frozen router leaves the rest of the model training"
    for cloned, trained in zip(jax.tree.leaves(start["mtp_1"]),
                               jax.tree.leaves(final["params"]["mtp_1"])):
        if cloned.ndim == 2:  # the cloned MTP-2 trains in the clone stage
            assert not np.array_equal(cloned, trained)
    assert train_main(["--recipe", str(path), "--workdir", str(workdir)]) == 0
    assert "nothing to do: every stage" in capsys.readouterr().out

    # Stage 1 lengthened: stage 2 was built on its old end, so the recipe is refused before
    # anything trains or is written, naming what to move.
    written = lambda: {p: p.stat().st_mtime_ns for p in workdir.rglob("*")  # noqa: E731
                       if p.is_file() and p.name != ".lock"}  # (the lock is taken and let go)
    saved = written()
    longer = write_recipe(tmp_path, [{"name": "pre", "overrides": ["train.steps=4"]},
                                     *yaml.safe_load(path.read_text())["stages"][1:]])
    assert train_main(["--recipe", str(longer), "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pre will train on from step 3 to 4" in err
    assert f"mv {recipe.stage_dir(workdir, 1)} " in err
    assert written() == saved


def test_changed_finished_stage_is_refused(tmp_path, capsys, monkeypatch):
    import train.checkpoint as checkpoint_module
    import train.experiments.recipe as recipe_module

    path = write_recipe(tmp_path, [{"name": "a", "overrides": ["train.steps=2"]},
                                   {"name": "b", "overrides": ["train.steps=2"]}])
    stage_a = load_recipe(path).stage_dir(tmp_path / "run", 0)
    saved = load_recipe(path).stage_config(0).to_dict()
    saved["train"]["lr"] = 0.5
    monkeypatch.setattr(recipe_module, "latest_checkpoint_step", lambda d: 2 if d == stage_a else None)
    monkeypatch.setattr(checkpoint_module, "latest_run_config", lambda d: (2, saved))
    assert train_main(["--recipe", str(path), "--workdir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "stage a" in err and "train.lr" in err and err.count("\n") == 1


# ---- command line ------------------------------------------------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["--config", str(TINY)], "not allowed with argument"),
    ([], "one of the arguments --config --recipe is required"),
])
def test_config_and_recipe_are_exclusive(tmp_path, capsys, args, needle):
    path = write_recipe(tmp_path, [{"name": "a"}])
    argv = ["--recipe", str(path), *args] if args else []
    with pytest.raises(SystemExit) as exit_info:
        train_main([*argv, "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and needle in err and err.count("\n") == 1


def test_bad_recipe_is_a_one_line_error(tmp_path, capsys):
    path = write_recipe(tmp_path, [{"name": "a", "clone_mtp": True}])
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--recipe", str(path), "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "no MTP-1 to clone" in err and err.count("\n") == 1
