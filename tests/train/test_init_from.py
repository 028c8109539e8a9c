"""`python -m train --init-from SRC` (train/init_from.py): a new run takes SRC's weights (a
workdir's latest step or `DIR/checkpoints/<step>`) with a fresh optimizer state and step 0; a
run YAML without a model takes SRC's; a model with other parameters is refused before anything
is compiled, naming each field; another tokenizer is refused; resuming never re-reads SRC and a
workdir of another start is refused. `python -m train.eval` takes the same sources (`--model`)
and other corpora (`--data`). The source is a real 3-step run with the recipe and sweep tests'
settings (one shared compiled step)."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
import yaml
from train_helpers import SMALL_LOOP, TINY

from model.config import config_to_dict
from model.interop.workdir import latest_run_config
from model.tokenizers.text import load_tokenizer
from model.weights import load_model, save_model_dir
from train.__main__ import main as train_main
from train.config import load_run_config
from train.experiments.recipe import load_recipe
from train.eval import main as eval_main
from train.init_from import check_init_source, model_changes
from train.loop import Trainer, train


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A `python -m train` workdir with checkpoints at steps 1, 2 and 3."""
    workdir = tmp_path_factory.mktemp("init") / "source"
    train(load_run_config(TINY, [*SMALL_LOOP, "train.checkpoint_every=1"]), workdir)
    return workdir


def train_only_yaml(tmp_path):
    """A run YAML with no `model:` section: it takes --init-from's model. Its training settings
    are the source's, so the two share one compiled step."""
    fields = {key: value for key, value in (item.split("=", 1) for item in SMALL_LOOP)
              if key.startswith("train.")}
    values = {key.removeprefix("train."): yaml.safe_load(value) for key, value in fields.items()}
    path = tmp_path / "finetune.yaml"
    path.write_text(yaml.safe_dump({"train": values}))
    return path


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("step", [None, 2])
def test_a_new_run_takes_the_weights_and_a_fresh_optimizer(source, tmp_path, step):
    where = source if step is None else source / "checkpoints" / str(step)
    run = load_run_config(TINY, [*SMALL_LOOP, f"train.init_from={json.dumps(str(where))}"])
    (tmp_path / "run").mkdir()  # as `train` makes it
    trainer = Trainer(run, tmp_path / "run")
    try:
        state = trainer.initial_state(trainer.start_variables(None))
    finally:
        trainer.checkpoints.close()
    _, expected = load_model(where)
    assert int(state.step) == 0 and int(state.skipped) == 0
    assert_trees_equal(state.params, expected["params"])
    assert_trees_equal(state.balance, expected["balance"])
    assert_trees_equal(state.opt_state, trainer.training.optimizer.init(state.params))
    if step is not None:  # the step named, not the latest
        latest = load_model(source)[1]["params"]
        assert not np.array_equal(np.asarray(jax.tree.leaves(latest)[0]),
                                  np.asarray(jax.tree.leaves(expected["params"])[0]))


@pytest.mark.slow
def test_fine_tune_from_the_command_line_and_the_resume_rules(source, tmp_path, capsys):
    config, workdir = train_only_yaml(tmp_path), tmp_path / "ft"
    command = ["--config", str(config), "--workdir", str(workdir)]
    assert train_main([*command, "--init-from", str(source)]) == 0
    out = capsys.readouterr().out
    assert f"starting from the weights of {source}" in out and "finished at step 3" in out
    step, saved = latest_run_config(workdir)
    assert step == 3 and saved["train"]["init_from"] == str(source)
    assert load_model(workdir)[0] == load_model(source)[0]  # the YAML had no model: SRC's

    # The same command resumes (nothing left to do here).
    assert train_main([*command, "--init-from", str(source)]) == 0
    assert "nothing to do" in capsys.readouterr().out

    # Another start into that workdir, or a start into a workdir of a random-init run: refused.
    for argv in ([*command, "--init-from", str(source / "checkpoints" / "2")],
                 ["--config", str(TINY), "--workdir", str(source), *SMALL_LOOP,
                  "--init-from", str(workdir)]):
        assert train_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "train.init_from" in err and "cannot resume" in err


def test_another_architecture_is_named_field_by_field_before_any_work(source, tmp_path, capsys):
    workdir = tmp_path / "run"
    argv = ["--config", str(TINY), "--workdir", str(workdir), *SMALL_LOOP, "model.d_model=48",
            "model.num_layers=4", "model.layout=SSSF", "model.swiglu_limits=[0, 0, 0, 7.0]",
            "model.swiglu_limits_shared=[0, 0, 0, 16.0]", "--init-from", str(source)]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: train.init_from: this run's model")
    for shown in ("model.d_model (32 -> 48)", "model.num_layers (5 -> 4)",
                  "model.layout (FSSSF -> SSSF)"):
        assert shown in err
    assert not workdir.exists()  # refused before the run wrote anything


def test_shape_keeping_changes_are_noted_and_other_tokenizers_refused(source):
    run = load_run_config(TINY, [*SMALL_LOOP, "model.full_attention.rope_theta=50000.0",
                                 "model.window=4", "model.attention_impl=xla"])
    note = check_init_source(str(source), run.model, load_tokenizer("default"))
    assert "model.full_attention.rope_theta (10000.0 -> 50000.0)" in note
    assert "model.window (8 -> 4)" in note and "attention_impl" not in note
    changed, kept = model_changes(run.model, run.model)
    assert changed == kept == []
    with pytest.raises(ValueError, match="tokenizer 'arith_chars'.* is not the one"):
        check_init_source(str(source), run.model, load_tokenizer("arith_chars"))
    with pytest.raises(ValueError, match="train.init_from: .*no checkpoint of step 7; saved "
                                         "steps: 1, 2, 3"):
        check_init_source(str(source / "checkpoints" / "7"), run.model, load_tokenizer("default"))


def test_eval_takes_another_corpus_and_any_model(source, tmp_path, capsys):
    """`--data` with the run's own source reads exactly the run's batches; another corpus is
    read with the run's tokenizer; a model directory (no data of its own) needs `--data`."""
    def evaluate(*args):
        assert eval_main([*args, "--batches", "2", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    own = evaluate("--model", str(source))
    assert evaluate("--model", str(source / "checkpoints" / "3"), "--data", "stdlib") == {
        **own, "model": str(source)}
    corpus = tmp_path / "notes.jsonl"  # 40 documents, read from their train split
    corpus.write_text("".join(json.dumps({"text": f"note {i}: " + "the cat sat. " * (i + 3)})
                              + "\n" for i in range(40)))
    other = evaluate("--model", str(source), "--data", str(corpus), "--split", "train")
    assert other["data"] == str(corpus) and other["tokens"] > 0 and other["loss"] != own["loss"]
    config, variables = load_model(source)
    save_model_dir(config, variables, tmp_path / "model")
    assert eval_main(["--model", str(tmp_path / "model")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--data: " in err and "is a model directory without" in err
    result = evaluate("--model", str(tmp_path / "model"), "--data", str(corpus), "--split",
                      "train", "--tokenizer", "default", "--seq-len", "16", "--batch-size", "4")
    assert result["step"] is None and math.isfinite(result["loss"])


def test_the_shipped_fine_tuning_config_takes_the_models_of_its_sources():
    """configs/finetune/ holds run YAMLs without a model, for `--init-from`."""
    for path in sorted((TINY.parent / "finetune").glob("*.yaml")):
        tiny = load_run_config(TINY).model
        assert load_run_config(path, model=config_to_dict(tiny)).model == tiny, path
        with pytest.raises(ValueError, match="defines no model"):
            load_run_config(path)


def test_an_empty_init_from_is_no_source(tmp_path, capsys):
    """`--init-from ''` names no weights: a run YAML without a model is refused as without the
    flag, not given a default model."""
    argv = ["--config", str(train_only_yaml(tmp_path)), "--print-config", "--init-from", ""]
    with pytest.raises(SystemExit) as exit_info:
        train_main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and "defines no model" in err, err


def test_a_recipe_starts_only_its_first_stage_from_init_from(tmp_path):
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump({"base": str(TINY), "overrides": SMALL_LOOP,
                                           "stages": [{"name": "a"}, {"name": "b"}]}))
    extra = ['train.init_from="runs/pretrained"']  # what `--init-from runs/pretrained` adds
    recipe = load_recipe(recipe_file, extra)
    assert [recipe.stage_config(i, extra).train.init_from for i in (0, 1)] == [
        "runs/pretrained", ""]
