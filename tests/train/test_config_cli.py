"""Configs a person can see: `--print-config` on `train`, `rl` and `model.generate` (the resolved
config as YAML, read back equal, nothing built or written), one override spelling per tool with
the other refused naming the right one, and "did you mean" for mistyped fields."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from train_helpers import SMALL_MODEL, TINY

from model.config import load_config
from model.generate import main as generate_main
from model.interop.workdir import Checkpointer
from model.summary import main as summary_main
from rl.__main__ import main as rl_main
from rl.config import load_rl_config
from train.__main__ import main as train_main
from train.config import load_run_config
from train.experiments.recipe import load_recipe

RL_ARITH = TINY.parent / "rl_arith.yaml"
RECIPE = TINY.parent / "recipes" / "tiny_staged.yaml"


def exit_code(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as exit_info:
        return exit_info.code


def error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_train_prints_the_resolved_config_and_builds_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = [*SMALL_MODEL, "train.steps=7", "train.lr=1e-3"]
    assert train_main(["--config", str(TINY), "--print-config", *overrides]) == 0
    text = capsys.readouterr().out
    (tmp_path / "printed.yaml").write_text(text)
    assert load_run_config(tmp_path / "printed.yaml") == load_run_config(TINY, overrides)
    assert list(tmp_path.iterdir()) == [tmp_path / "printed.yaml"]  # no workdir, no cache


def test_a_recipe_prints_one_document_per_stage(capsys):
    assert train_main(["--recipe", str(RECIPE), "--print-config", "train.log_every=7"]) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    recipe = yaml.safe_load(RECIPE.read_text())
    assert len(documents) == len(recipe["stages"])
    assert all(d["train"]["log_every"] == 7 and set(d) == {"model", "train", "mesh"}
               for d in documents)


def test_train_without_print_config_still_needs_a_workdir(capsys):
    assert exit_code(train_main, ["--config", str(TINY)]) == 2
    assert error_line(capsys) == "error: --workdir DIR is required"


def fake_training_workdir(path, model_overrides):
    """A workdir whose latest checkpoint holds only the saved run config (all a config read
    needs; the weights are never read)."""
    run = load_run_config(TINY, [*SMALL_MODEL, *model_overrides])
    checkpoints = Checkpointer(path / "checkpoints", keep=2)
    checkpoints.save(4, {"w": np.zeros(2, np.float32)}, {}, run.to_dict())
    checkpoints.close()
    return run


def test_rl_prints_its_config_with_the_init_from_model(tmp_path, capsys):
    source = fake_training_workdir(tmp_path / "sft", ["model.vocab_size=4096"])
    argv = ["--config", str(RL_ARITH), "--init-from", str(tmp_path / "sft"), "--print-config",
            "rl.iterations=3", "model.qat.expert_weights=mxfp4"]
    assert rl_main(argv) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    run = load_rl_config(RL_ARITH, ["rl.iterations=3", "model.qat.expert_weights=mxfp4"])
    expected = run.with_model(source.model, checkpoint=True).to_dict()
    assert printed == json.loads(json.dumps(expected))  # tuples as lists
    assert printed["model"]["qat"]["expert_weights"] == "mxfp4"  # the command line's QAT
    assert printed["model"]["d_model"] == source.model.d_model  # the checkpoint's architecture
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft"]


def test_generate_prints_the_model_and_its_settings_without_weights(tmp_path, capsys):
    source = fake_training_workdir(tmp_path / "run", [])
    argv = ["--workdir", str(tmp_path / "run"), "--print-config", "--temperature", "0.7"]
    assert generate_main(argv) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"] == json.loads(json.dumps(source.to_dict()["model"]))
    assert printed["generate"]["temperature"] == 0.7 and printed["generate"]["prompt"] is None
    assert exit_code(generate_main, ["--workdir", str(tmp_path / "run")]) == 2
    assert error_line(capsys) == ("error: one of --prompt or --prompt-file is required (or "
                                  "--chat alone for a conversation)")


# ---- one spelling per tool -------------------------------------------------------------------


def test_model_tools_refuse_the_run_spelling_naming_theirs(capsys):
    with pytest.raises(ValueError, match=r"^override 'model.layout=F\+SSSC\*2': model tools name "
                                         r"model fields without the 'model.' prefix; use "
                                         r"layout=F\+SSSC\*2 here$"):
        load_config(TINY, ["model.layout=F+SSSC*2"])
    assert exit_code(summary_main, ["--config", str(TINY), "model.moe.top_k=2"]) == 2
    assert error_line(capsys).endswith("use moe.top_k=2 here")


@pytest.mark.parametrize("main, config, override, spelling", [
    (train_main, TINY, "layout=F+SSSC*2", "model.layout=F+SSSC*2"),
    (train_main, TINY, "steps=5", "train.steps=5"),
    (rl_main, RL_ARITH, "algorithm=ppo", "rl.algorithm=ppo"),
])
def test_run_tools_refuse_the_model_spelling_naming_theirs(tmp_path, capsys, main, config,
                                                           override, spelling):
    argv = ["--config", str(config), "--workdir", str(tmp_path / "run"), override]
    assert exit_code(main, argv) == 2
    assert error_line(capsys).endswith(f"; use {spelling} here")
    assert not (tmp_path / "run").exists()


# ---- did you mean ----------------------------------------------------------------------------


@pytest.mark.parametrize("load, overrides, suggestion", [
    (lambda o: load_config(TINY, o), ["moe.topk=2"], "moe.top_k"),
    (lambda o: load_config(TINY, o), ["top_k=2"], "moe.top_k"),  # the field one level down
    (lambda o: load_run_config(TINY, o), ["train.stepz=3"], "train.steps"),
    (lambda o: load_run_config(TINY, o), ["train.muon.stepz=3"], "train.muon.steps"),
    (lambda o: load_run_config(TINY, o), ["model.d_modle=64"], "model.d_model"),
    (lambda o: load_run_config(TINY, o), ["trian.steps=3"], "train.steps"),
    (lambda o: load_run_config(TINY, o), ["train.wandb.projct=x"], "train.wandb.project"),
    (lambda o: load_rl_config(RL_ARITH, o), ["rl.algoritm=ppo"], "rl.algorithm"),
])
def test_a_mistyped_field_is_answered_with_the_closest_one(load, overrides, suggestion):
    with pytest.raises(ValueError, match=rf"\(did you mean '{suggestion}'\?\)"):
        load(overrides)


def test_a_mistyped_section_in_a_file_is_answered_too(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(TINY.read_text() + "\ntrian: {steps: 3}\n")
    with pytest.raises(ValueError, match=r"unknown top-level section\(s\) \['trian'\] \(did you "
                                         r"mean 'train'\?\)"):
        load_run_config(path)


def test_a_mistyped_key_in_a_recipe_file_is_answered_too(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"base: {TINY}\nstags: []\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stags'\] \(did you mean "
                                         r"'stages'\?\)"):
        load_recipe(path)


def test_nothing_far_from_every_field_gets_a_suggestion():
    with pytest.raises(ValueError) as info:
        load_config(TINY, ["zzz=1"])
    assert "did you mean" not in str(info.value) and "zzz: unknown config field" in str(info.value)
