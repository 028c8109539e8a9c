"""A finished RL workdir as a model source: what `model` reads of it, for the RL loop tests."""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp

from model.generate import main as generate_main
from model.hf import main as hf_main
from model.weights import load_model
from train.eval import main as eval_main


def check_rl_workdir_is_a_model_source(workdir, model_config, tmp_path, capsys):
    """The policy an RL run trained loads as a model (load_model, generate --workdir), exports
    as a complete Hugging Face directory (its tokenizer beside it: generate --hf reads it and
    answers the same), and train.eval says what the directory is."""
    config, variables = load_model(workdir)
    with ocp.PyTreeCheckpointer() as checkpointer:  # the raw tree orbax saved, no target
        saved = checkpointer.restore(workdir / "checkpoints" / "2" / "state")
    assert config == model_config
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(variables)[0],
                                 jax.tree.leaves({"params": saved["actor"]["params"],
                                                  "balance": saved["actor"]["balance"]})):
        assert np.array_equal(np.asarray(got), np.asarray(want)), jax.tree_util.keystr(path)
    assert hf_main(["export", str(workdir), "--out", str(tmp_path / "hf")]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    capsys.readouterr()
    answers = []
    for source in (["--workdir", str(workdir)], ["--hf", str(tmp_path / "hf")]):
        assert generate_main([*source, "--prompt", "12+7=", "--max-new-tokens", "3",
                              "--json"]) == 0
        answers.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert answers[0] == answers[1] and len(answers[0]) >= 1
    assert eval_main(["--workdir", str(workdir)]) == 2
    assert capsys.readouterr().err == (
        f"error: {workdir} is a workdir of `python -m rl`, not of `python -m train`; its "
        "held-out accuracy is eval/accuracy in its metrics.jsonl (python -m rl.compare "
        "compares RL runs)\n")
