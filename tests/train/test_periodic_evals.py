"""Evaluations during training (train/periodic.py): `train.eval_tasks` runs an lm-eval task at
`eval_every` and `train.sample_every` logs greedy generations from held-out rows, both into
metrics.jsonl and on the terminal, from the weights of that step (the final step's agree with
the saved checkpoint evaluated afterwards), without changing the training losses. The run has the recipe and sweep tests' settings,
so it shares their compiled train step. A mesh the decoder cannot run under is refused at set-up."""

from __future__ import annotations

import os

import pytest
from train_helpers import SMALL_LOOP, TINY

from model.inference.decode import Decoder
from model.parallel.rules import abstract_mesh
from model.tokenizers.text import load_tokenizer
from model.weights import load_model
from train.config import load_run_config
from train.data.pipeline import make_dataset
from train.lm_eval import evaluate_tasks, task_manager, task_metrics
from train.loop import train
from train.periodic import check_decodable
from train.telemetry.metrics import read_metrics

os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"

TASK, TASKS_DIR = "stepjax_python_choice", "tests/lm_eval_tasks"
EVALS = ["train.eval_every=3", f"train.eval_tasks.tasks=[{TASK}]",
         f"train.eval_tasks.include_path={TASKS_DIR}", "train.eval_tasks.limit=3",
         "train.eval_tasks.batch_size=4", "train.sample_every=3", "train.samples.count=2",
         "train.samples.prompt_tokens=6", "train.samples.max_new_tokens=4",
         "train.progress=true"]  # evaluations print their lines through the progress bar


@pytest.mark.lm_eval
@pytest.mark.slow
def test_tasks_and_samples_are_logged_from_the_weights_of_their_step(tmp_path, capsys,
                                                                     monkeypatch):
    from model.inference.harness import HarnessLM

    monkeypatch.chdir(TINY.parents[1])  # the task's data path is relative to the repository
    workdir = tmp_path / "run"
    losses = train(load_run_config(TINY, [*SMALL_LOOP, *EVALS]), workdir).losses
    assert train(load_run_config(TINY, SMALL_LOOP), tmp_path / "plain").losses == losses
    final = read_metrics(workdir / "metrics.jsonl")[-1]
    assert final["step"] == 3 and 0.0 <= final[f"eval/{TASK}/acc"] <= 1.0
    out = "".join(capsys.readouterr())
    assert f"step 3: {TASK}/acc " in out and "step 3 sample 1: " in out

    config, variables = load_model(workdir)
    tokenizer = load_tokenizer("default")
    decoder = Decoder(config, variables, max_len=16)
    lm = HarnessLM(decoder, tokenizer, batch_size=4, progress=False)
    results = evaluate_tasks(lm, [TASK], task_manager([TASK], TASKS_DIR), limit=3,
                             num_fewshot=None, bootstrap_iters=0)
    assert task_metrics(results)[f"eval/{TASK}/acc"] == final[f"eval/{TASK}/acc"]
    # The samples: the first 6 tokens of the first 2 held-out rows, continued greedily.
    run = load_run_config(TINY, [*SMALL_LOOP, *EVALS])
    rows = next(make_dataset(run.train.data, tokenizer, seq_len=16, batch_size=4,
                             split="heldout", seed=run.train.seed))["tokens"][:2, :6].tolist()
    continued = decoder.generate(rows, 4, stop_ids=(tokenizer.eos_id,)).tokens
    for i, (prompt, tokens) in enumerate(zip(rows, continued)):
        assert final[f"samples/{i}"] == tokenizer.decode(prompt) + tokenizer.decode(tokens)


def test_a_context_axis_is_refused_before_the_first_step():
    """KV-cache decoding needs whole sequences (model/layers/stack.py): samples under
    mesh.context=2 are refused when the run is set up, not at their first step."""
    run = load_run_config(TINY, [*SMALL_LOOP, "mesh.context=2", "train.sample_every=1",
                                 "train.samples.prompt_tokens=4", "train.samples.max_new_tokens=4"])
    with pytest.raises(ValueError, match=r"^train.eval_tasks and train.sample_every decode "
                                         r"whole sequences: use mesh.context=1$"):
        check_decodable(run, abstract_mesh({"context": 2}))
