"""Tests of ablation sweeps (`train.experiments.sweep_file`, `.sweep`, `.sweep_report`): expansion
of the sweep file, one real 2-run sweep (results.csv / results.md / plots, a failing run that does
not stop the others, re-running does no new work) and the command line's one-line errors."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import yaml
from train_helpers import SMALL_LOOP, TINY, TINY_V4

import train.experiments.sweep as sweep_module
from model.flops import kv_cache_bytes
from model.summary import count_params
from train.experiments.sweep import main, run_sweep
from train.experiments.sweep_file import load_sweep
from train.experiments.sweep_report import KV_CONTEXT, markdown_table
from train.loop import TrainingError, TrainSummary
from train.telemetry.metrics import read_metrics
from train.telemetry.mfu import train_flops_per_token

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_sweep(tmp_path: Path, **values) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": str(TINY), **values}, sort_keys=False))
    return path


# ---- the sweep file ----------------------------------------------------------------------------


def test_grid_is_a_cartesian_product_and_runs_cross_it(tmp_path):
    sweep = load_sweep(write_sweep(
        tmp_path, overrides=["train.steps=3", "train.warmup_steps=1", "train.eval_every=0"],
        grid={"train.lr": [0.001, 0.003], "model.gate": ["sink", "none"]},
        runs=[{"name": "a", "overrides": ["model.window=16"]}, {"name": "b"}]))
    names = [r.name for r in sweep.runs]
    assert names == ["a,lr=0.001,gate=sink", "a,lr=0.001,gate=none", "a,lr=0.003,gate=sink",
                     "a,lr=0.003,gate=none", "b,lr=0.001,gate=sink", "b,lr=0.001,gate=none",
                     "b,lr=0.003,gate=sink", "b,lr=0.003,gate=none"]
    config = sweep.run_config(sweep.runs[2])
    assert (config.train.lr, config.model.gate, config.model.window) == (0.003, "sink", 16)
    assert config.train.steps == 3
    # A run without periodic evaluation still ends with one.
    assert config.train.eval_every == 3


def test_shipped_sweeps_load():
    root = Path(__file__).resolve().parents[2]
    names = {path.stem: [r.name for r in load_sweep(path).runs]
             for path in sorted((root / "configs" / "sweeps").glob("*.yaml"))}
    assert names["layout"] == ["FFFF", "S1F1", "S3F1", "S3F1+Head"]
    assert names["gate"] == ["gate=headwise", "gate=sink", "gate=none", "5to1,W=129,swa_sink",
                             "5to1,W=129,gate=headwise", "5to1,W=129,gate=none"]
    assert names["optimizer"] == ["optimizer=muon", "optimizer=adamw"]
    assert names["balance"] == ["loss-free", "ep-group-loss", "both", "neither"]
    assert names["deepseek_v4"] == ["V4", "no-mHC", "window-only", "no-hash"]
    v4 = load_sweep(root / "configs" / "sweeps" / "deepseek_v4.yaml")
    models = {r.name: v4.run_config(r).model for r in v4.runs}
    assert (models["V4"].layout, models["window-only"].layout) == ("WWCHCH", "W" * 6)
    assert (models["V4"].hyper_connections.hc_mult, models["no-mHC"].hyper_connections.hc_mult,
            models["V4"].moe.hash_layers, models["no-hash"].moe.hash_layers) == (4, 1, 1, 0)
    layout = load_sweep(root / "configs" / "sweeps" / "layout.yaml")
    layouts = {r.name: layout.run_config(r).model for r in layout.runs}
    assert layouts["FFFF"].layout == "F" * 9
    assert layouts["S3F1"].layout == layouts["S3F1+Head"].layout == "FSSSFSSSF"
    assert (layouts["S3F1"].swa_attention.num_heads,
            layouts["S3F1+Head"].swa_attention.num_heads) == (4, 6)
    # Gate vs MiMo's sink: the S3F1 runs keep the tiny model's layout and window; the 5:1 runs
    # take MiMo's first nine layers and W = 128 + 1, the sink on sliding-window layers only.
    gate = load_sweep(root / "configs" / "sweeps" / "gate.yaml")
    gates = {r.name: gate.run_config(r).model for r in gate.runs}
    assert {(m.layout, m.window) for n, m in gates.items() if n.startswith("gate=")} == {
        ("FSSSFSSSF", 32)}
    assert {(m.layout, m.window) for n, m in gates.items() if n.startswith("5to1")} == {
        ("FSSSSFSSS", 129)}
    resolved = {n: (m.attention_geometry("S").gate, m.attention_geometry("F").gate)
                for n, m in gates.items()}
    assert resolved == {"gate=headwise": ("headwise", "headwise"), "gate=sink": ("sink", "sink"),
                        "gate=none": ("none", "none"), "5to1,W=129,swa_sink": ("sink", "none"),
                        "5to1,W=129,gate=headwise": ("headwise", "headwise"),
                        "5to1,W=129,gate=none": ("none", "none")}


def test_a_named_run_may_start_from_its_own_base(tmp_path):
    """Families with different presets in one sweep: a run's `base` replaces the sweep's, the
    sweep-wide and command-line overrides still apply, and a grid keeps each run's base."""
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "v4.yaml").write_text(TINY_V4.read_text())
    path = write_sweep(tmp_path, overrides=["train.steps=3", "train.warmup_steps=1"],
                       grid={"train.seed": [0, 1]},
                       runs=[{"name": "step35"},  # relative to the sweep file's directory:
                             {"name": "v4", "base": "presets/v4.yaml",
                              "overrides": ["model.moe.expert_hidden=80"]}])
    sweep = load_sweep(path, ["train.lr=0.001"])
    assert [(r.name, r.base) for r in sweep.runs] == [
        ("step35,seed=0", None), ("step35,seed=1", None),
        ("v4,seed=0", tmp_path / "presets" / "v4.yaml"),
        ("v4,seed=1", tmp_path / "presets" / "v4.yaml")]
    step35, v4 = sweep.run_config(sweep.runs[1]), sweep.run_config(sweep.runs[3])
    assert (step35.model.layout, v4.model.layout) == ("FSSSFSSSF", "WWCHCH")
    assert (v4.model.moe.expert_hidden, v4.train.steps, v4.train.lr, v4.train.seed) == (
        80, 3, 0.001, 1)
    with pytest.raises(ValueError, match=r"sweep runs\[0\] base: nope.yaml not found"):
        load_sweep(write_sweep(tmp_path, runs=[{"name": "a", "base": "nope.yaml"}]))


@pytest.mark.slow
def test_families_sweep_matches_active_parameters():
    """configs/sweeps/families.yaml: each family from its own preset, active parameters without
    embeddings and output head within 1.5% of the Step 3.5 run's (docs/experiments.md states
    them)."""
    root = Path(__file__).resolve().parents[2]
    sweep = load_sweep(root / "configs" / "sweeps" / "families.yaml")
    configs = {r.name: sweep.run_config(r) for r in sweep.runs}
    assert list(configs) == ["step35", "mimo", "deepseek_v4", "step35+mHC", "mimo+mHC",
                             "mimo+gate"]
    active = {n: count_params(c.model)["active_excl_embeddings"] for n, c in configs.items()}
    assert active["step35"] == 1_696_704
    assert all(abs(a / active["step35"] - 1) < 0.015 for a in active.values()), active
    models = {n: c.model for n, c in configs.items()}
    assert {n: (m.layout, m.hyper_connections.hc_mult) for n, m in models.items()} == {
        "step35": ("FSSSFSSSF", 1), "mimo": ("FSSSSFSSS", 1), "deepseek_v4": ("WWCHCH", 4),
        "step35+mHC": ("FSSSFSSSF", 4), "mimo+mHC": ("FSSSSFSSS", 4),
        "mimo+gate": ("FSSSSFSSS", 1)}
    gates = {n: (m.attention_geometry("S").gate, m.attention_geometry("F").gate)
             for n, m in models.items() if n.startswith("mimo")}
    assert gates == {"mimo": ("sink", "none"), "mimo+mHC": ("sink", "none"),
                     "mimo+gate": ("headwise", "headwise")}
    assert len({(c.train.steps, c.train.batch_size, c.train.seq_len, c.train.data.source,
                 c.train.seed, c.trained_mtp_heads()) for c in configs.values()}) == 1


@pytest.mark.parametrize("values, needle", [
    ({"grid": {"train.lr": [1e-3]}, "extra": 1}, "unknown key(s) ['extra']"),
    ({}, "needs a 'grid' and/or a 'runs' list"),
    ({"grid": {"train.lr": []}}, "grid.train.lr: expected a non-empty list"),
    ({"runs": [{"name": "a"}, {"name": "a"}]}, "run names must be unique"),
    ({"runs": [{"name": "a", "overrides": ["train.lr"]}]}, "runs[0].overrides"),
    ({"runs": [{"name": "bad", "overrides": ["model.no_such_field=1"]}]}, "sweep run bad:"),
    ({"grid": {"train.lr": [1e-3]}, "base": "missing.yaml"}, "missing.yaml not found"),
])
def test_bad_sweep_files_name_the_problem(tmp_path, values, needle):
    with pytest.raises(ValueError) as err:
        load_sweep(write_sweep(tmp_path, **values))
    assert needle in str(err.value)


# ---- a real sweep ------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_run_sweep_reports_and_a_rerun_does_no_new_work(tmp_path, monkeypatch, capsys):
    # Two seeds: one compiled step serves both runs (the recipe test shares it too).
    path = write_sweep(tmp_path, overrides=SMALL_LOOP, grid={"train.seed": [0, 1]},
                       metrics=["moe/load_max_over_mean"])
    workdir = tmp_path / "out"
    assert main(["--sweep", str(path), "--workdir", str(workdir)]) == 0
    for name in ("results.csv", "results.md", "loss_curves.png", "quality_vs_flops.png"):
        assert (workdir / name).is_file(), name
    for name in ("loss_curves.png", "quality_vs_flops.png"):
        assert (workdir / name).read_bytes()[:8] == PNG_MAGIC

    rows = list(csv.DictReader((workdir / "results.csv").open()))
    assert [r["name"] for r in rows] == ["seed=0", "seed=1"]
    config = load_sweep(path).run_config(load_sweep(path).runs[0])
    for row in rows:
        records = read_metrics(workdir / "runs" / row["name"] / "metrics.jsonl")
        evals = [r["eval/loss"] for r in records if "eval/loss" in r]
        assert len(evals) == 1 and math.isclose(float(row["heldout_loss"]), evals[0])
        assert math.isclose(float(row["train_loss"]), records[-1]["loss/lm"])
        assert row["status"] == "finished" and int(row["steps"]) == 3
        assert int(row["tokens"]) == 3 * 4 * 16
        assert int(row["params_total"]) == count_params(config.model)["total"]
        assert int(row["params_active_excl_embeddings"]) == count_params(
            config.model)["active_excl_embeddings"]
        assert int(row["kv_cache_bytes_32k"]) == kv_cache_bytes(config.model, KV_CONTEXT)
        assert row["base"] == str(TINY)
        assert math.isclose(float(row["train_flops"]), 3 * 4 * 16 * train_flops_per_token(
            config.model, 16, config.trained_mtp_heads()))
        assert math.isfinite(float(row["moe/load_max_over_mean"]))
        assert float(row["train_seconds"]) > 0
    assert rows[0]["heldout_loss"] != rows[1]["heldout_loss"]  # the seeds did differ
    table = (workdir / "results.md").read_text()
    assert "| seed=0 |" in table and "| seed=1 |" in table

    before = (workdir / "results.csv").read_text()
    checkpoints = {p: p.stat().st_mtime_ns for p in workdir.rglob("checkpoints/*")}
    calls = []
    monkeypatch.setattr(sweep_module, "train", lambda *a, **k: calls.append(a) or 1 / 0)
    capsys.readouterr()
    assert main(["--sweep", str(path), "--workdir", str(workdir)]) == 0
    assert calls == []
    assert "trained 0, already finished 2" in capsys.readouterr().out
    assert (workdir / "results.csv").read_text() == before
    assert {p: p.stat().st_mtime_ns for p in workdir.rglob("checkpoints/*")} == checkpoints


def test_markdown_table_keeps_small_metrics_readable():
    row = {"name": "r", "heldout_loss": 4.86621, "train_loss": None, "steps": 3, "tokens": 192,
           "params_total": 5_000_000, "params_active": 2_500_000, "train_flops": 1.5e9,
           "kv_cache_bytes_32k": 50_479_104, "tokens_per_sec": 1234.6, "train_seconds": 61.0,
           "update_rms/muon": 0.000123, "moe/load_max_over_mean": 2.5}
    line = markdown_table([row], ["update_rms/muon", "moe/load_max_over_mean"]).splitlines()[2]
    assert line.startswith("| r | 4.8662 | – | 3 |")
    assert line.endswith("| 1.5e+09 | 50.48 MB | 1235 | 1 min 01 s | 0.000123 | 2.5 |")


def test_a_failing_run_is_reported_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    path = write_sweep(tmp_path, overrides=SMALL_LOOP, runs=[{"name": "broken"}, {"name": "fine"}])
    trained = []

    def fake_train(run, workdir, **_):  # the slow test above trains for real
        if workdir.name == "broken":
            raise TrainingError("tokenizer has 4096 tokens but\nmodel.vocab_size=1000")
        trained.append(workdir.name)
        return TrainSummary(workdir, 0, 3, [1.0], 0, interrupted=False)

    monkeypatch.setattr(sweep_module, "train", fake_train)
    assert main(["--sweep", str(path), "--workdir", str(tmp_path / "out")]) == 1
    assert trained == ["fine"]
    captured = capsys.readouterr()
    assert "failed 1" in captured.out
    assert captured.err == "error: run broken: tokenizer has 4096 tokens but model.vocab_size=1000\n"
    outcome = run_sweep(load_sweep(path), tmp_path / "out2", only=["fine"], log=lambda _: None)
    assert outcome.trained == ["fine"] and outcome.failed == {}


def test_workdir_trained_with_another_config_is_refused(tmp_path, monkeypatch, capsys):
    import train.checkpoint as checkpoint_module

    path = write_sweep(tmp_path, overrides=SMALL_LOOP, runs=[{"name": "a"}])
    sweep = load_sweep(path)
    saved = sweep.run_config(sweep.runs[0]).to_dict()
    saved["train"]["seed"] = 7  # trained before with another seed, e.g. train.seed=7
    monkeypatch.setattr(sweep_module, "latest_checkpoint_step", lambda run_dir: 3)
    monkeypatch.setattr(checkpoint_module, "latest_run_config", lambda run_dir: (3, saved))
    monkeypatch.setattr(sweep_module, "train", lambda *a, **k: 1 / 0)
    assert main(["--sweep", str(path), "--workdir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: run a: ") and "different config (train.seed)" in err
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists(), "nothing written: not sweep.json, not a report"


# ---- command line ------------------------------------------------------------------------------


def test_help_and_list(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "results.csv" in capsys.readouterr().out
    path = write_sweep(tmp_path, grid={"train.optimizer": ["muon", "adamw"]})
    assert main(["--sweep", str(path), "--workdir", str(tmp_path / "w"), "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["optimizer=muon: train.optimizer=muon",
                   "optimizer=adamw: train.optimizer=adamw"]
    assert main(["--sweep", str(path), "train.seed=1", "--workdir", str(tmp_path / "w"),
                 "--list"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "optimizer=muon: train.optimizer=muon train.seed=1"
    assert not (tmp_path / "w").exists()


def test_command_line_overrides_apply_to_every_run_last(tmp_path):
    path = write_sweep(tmp_path, overrides=["train.seed=3"],
                       runs=[{"name": "a", "overrides": ["model.gate=sink"]}, {"name": "b"}])
    sweep = load_sweep(path, ["model.gate=none", "train.seed=1"])
    configs = [sweep.run_config(run) for run in sweep.runs]
    assert [(c.model.gate, c.train.seed) for c in configs] == [("none", 1), ("none", 1)]
    with pytest.raises(ValueError, match="command-line overrides"):
        load_sweep(path, ["train.seed"])


@pytest.mark.parametrize("args, needle", [
    (["--only", "nope"], "--only: no run named nope"),
    (["--sweep-file-is-missing"], "unrecognized arguments"),
    (["model.no_such_field=1"], "sweep run optimizer=muon:"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, args, needle):
    path = write_sweep(tmp_path, grid={"train.optimizer": ["muon"]})
    with pytest.raises(SystemExit) as exit_info:
        main(["--sweep", str(path), "--workdir", str(tmp_path / "w"), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and needle in err and err.count("\n") == 1


def test_unreadable_sweep_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: [unclosed")
    with pytest.raises(SystemExit) as exit_info:
        main(["--sweep", str(bad), "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and str(bad) in err and err.count("\n") == 1


def test_allow_data_change_reaches_every_run(tmp_path, monkeypatch):
    """`python -m train.sweep --allow-data-change` (named by the changed-data refusal) is passed
    to each run's `train`."""
    calls = []

    def fake_train(config, run_dir, **options):
        calls.append(options)
        return TrainSummary(workdir=run_dir, first_step=0, last_step=config.train.steps,
                            losses=[], skipped=0, interrupted=False)

    monkeypatch.setattr(sweep_module, "train", fake_train)
    path = write_sweep(tmp_path, overrides=["train.steps=3", "train.warmup_steps=1"],
                       runs=[{"name": "a"}, {"name": "b"}])
    assert main(["--sweep", str(path), "--workdir", str(tmp_path / "sweep"),
                 "--allow-data-change"]) == 0
    assert calls == [{"allow_data_change": True}] * 2
    calls.clear()
    assert main(["--sweep", str(path), "--workdir", str(tmp_path / "other")]) == 0
    assert calls == [{"allow_data_change": False}] * 2
