"""Every import path the docs (README.md, docs/) document still resolves, and to the code in its
room (a documented path that moved is a re-export, never a second copy)."""

import importlib
import runpy
import sys
import warnings

import pytest

# (documented module, name) -> (module holding the code, name)
DOCUMENTED = {
    ("model", "CausalLM"): ("model.lm", "CausalLM"),
    ("model", "ModelConfig"): ("model.config.model_config", "ModelConfig"),
    ("model", "load_config"): ("model.config.files", "load_config"),
    ("model.config", "ModelConfig"): ("model.config.model_config", "ModelConfig"),
    ("model.hf", "load_hf_checkpoint"): ("model.interop.hf", "load_hf_checkpoint"),
    ("model.weights", "load_model"): ("model.weights", "load_model"),
    ("model.decode", "Decoder"): ("model.inference.decode", "Decoder"),
    ("model.decode", "required_length"): ("model.inference.decode", "required_length"),
    ("model.sampling", "Sampling"): ("model.inference.sampling", "Sampling"),
    ("model.params", "convert_layer_layout"): ("model.layers.params", "convert_layer_layout"),
    ("model.summary", "count_params"): ("model.summary", "count_params"),
    ("model.summary", "render"): ("model.summary", "render"),
    ("train.tokenizer", "load_tokenizer"): ("model.tokenizers.text", "load_tokenizer"),
    ("train.metrics", "read_metrics"): ("train.telemetry.metrics", "read_metrics"),
    ("train.loop", "train"): ("train.loop", "train"),
    ("train.config", "TrainConfig"): ("train.config", "TrainConfig"),
    ("train.config", "load_run_config"): ("train.config", "load_run_config"),
}


@pytest.mark.parametrize("documented, home", sorted(DOCUMENTED.items()))
def test_documented_import_resolves_to_its_room(documented, home):
    got = getattr(importlib.import_module(documented[0]), documented[1])
    assert got is getattr(importlib.import_module(home[0]), home[1])


@pytest.mark.parametrize("command", ["train.plot", "train.sweep", "train.plan"])
def test_documented_commands_that_moved_still_run(command, monkeypatch, capsys):
    """`python -m COMMAND --help`, run as `__main__` in this process (no interpreter start-up)."""
    monkeypatch.setattr(sys, "argv", [command, "--help"])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exited:
        warnings.simplefilter("ignore", RuntimeWarning)  # "found in sys.modules": imported before
        runpy.run_module(command, run_name="__main__")
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m {command} ")
