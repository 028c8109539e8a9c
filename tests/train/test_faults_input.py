"""Fault injection, part 3: bad input a new user might give, refused before anything compiles
(one `error:` line naming the cause and the fix, exit 2, no workdir left behind), and a run that
diverges on its last step.

Run with the other parts: `python -m pytest -m faults`. Damaged HF checkpoints and a full disk
in `model.hf` are in test_faults_files.py; the cases of one module live beside it
(tests/model/test_chat_template_limits.py, test_hf_quantized.py, test_hf_deepseek_v4.py,
test_decode.py; tests/rl/test_rl_config.py, test_rl_loop.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from fault_helpers import run_args
from train_helpers import REPO, SMALL_MODEL, TINY

import train.loop
import train.preset_fit
from rl.__main__ import main as rl_main
from train.__main__ import main as train_main
from train.config import load_run_config
from train.parallel import distributed
from train.sweep import main as sweep_main

pytestmark = [pytest.mark.faults]

SFT = REPO / "configs" / "sft_arith.yaml"
SHIPPED_TOKENIZER = REPO / "model" / "tokenizers" / "assets" / "stdlib_bpe_4096.json"
RL = REPO / "configs" / "rl_arith.yaml"


def _one_line_error(capsys, *needles: str) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in lines if not line.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _exit_code(main, argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:  # argparse's error(): a config error, before any work
        return exit.code


def _refused(capsys, workdir: Path, argv: list[str], *needles: str, main=train_main) -> str:
    assert _exit_code(main, argv) == 2
    line = _one_line_error(capsys, *needles)
    assert not workdir.exists(), sorted(p.name for p in workdir.iterdir())
    return line


@pytest.mark.parametrize("override, needles", [
    ("model.norm_eps=.nan", ["model.norm_eps: must be a finite number, got nan"]),
    ("train.lr=.inf", ["train.lr: must be a finite number, got inf"]),
    ("model.swiglu_limits=[0, 0, 0, 0, .inf]", ["model.swiglu_limits: must be a finite number"]),
    ("model.vocab_size=3000000000", ["model.vocab_size: must be at most 2147483647"]),
    ("train.warmup_steps=10", ["train.warmup_steps: 10 warm-up steps exceed train.steps=6",
                               "set train.warmup_steps <= 6"]),
])
def test_bad_values_are_refused_before_the_workdir_exists(tmp_path, capsys, override, needles):
    workdir = tmp_path / "new" / "run"
    _refused(capsys, tmp_path / "new", ["--config", str(TINY), "--workdir", str(workdir),
                                        *SMALL_MODEL, "train.steps=6", override], *needles)


def test_a_short_run_of_a_preset_scales_its_warmup(capsys, monkeypatch):
    """configs/tiny.yaml warms up for 24 of 240 steps: train.steps=6 keeps that fraction (with
    a note); a longer run or an explicit warm-up keeps the given value."""
    monkeypatch.setattr(train.preset_fit, "_NOTED", set())  # each note is printed once a process
    assert load_run_config(TINY, ["train.steps=6"]).train.warmup_steps == 1  # round(0.6)
    assert load_run_config(TINY, ["train.steps=60"]).train.warmup_steps == 24  # fits: kept
    assert load_run_config(TINY, ["train.steps=6", "train.warmup_steps=0"]).train.warmup_steps == 0
    notes = capsys.readouterr().err.strip().splitlines()
    assert notes == ["note: train.warmup_steps: the config's 24 warm-up steps of 240 scaled to 1 "
                     "for train.steps=6; set train.warmup_steps to choose"], notes


def test_duplicate_yaml_keys_and_recipe_stages_that_change_shapes(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(TINY.read_text().replace("  steps: 240\n", "  steps: 240\n  lr: 1.0\n"))
    _refused(capsys, tmp_path / "a", ["--config", str(config), "--workdir", str(tmp_path / "a")],
             "key 'lr' is given twice (first on line 45); keep one (line 48, column 3)")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"base": str(TINY), "stages": [
        {"name": "first", "overrides": [*SMALL_MODEL, "train.steps=2"]},
        {"name": "wider", "overrides": [*SMALL_MODEL, "train.steps=2", "model.d_model=64"]}]}))
    _refused(capsys, tmp_path / "b", ["--recipe", str(recipe), "--workdir", str(tmp_path / "b")],
             "recipe stage wider: model.d_model (32 -> 64) change the model's parameters from "
             "stage first's", "only changes that keep every parameter shape")


def test_lone_surrogates_in_jsonl_are_named(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "fine"}\n{"text": "broken \\ud800 text"}\n{"text": "ok \\ud83d\\ude00"}\n')
    workdir = tmp_path / "run"
    _refused(capsys, workdir, run_args(workdir, f"train.data.source={data}"),
             f"{data}:2: a string holds a lone UTF-16 surrogate ('\\ud800')", "fix or remove it")


def test_a_chat_template_that_would_exhaust_memory(tmp_path, capsys):
    """A tokenizer directory whose chat template repeats a message 10^8 times: the run stops
    on its first chat, before the model is built."""
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    shutil.copyfile(SHIPPED_TOKENIZER, tokenizer / "tokenizer.json")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "chat_template": "{{ messages[0]['content'] * 100000000 }}"}))
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"},
                                                     {"role": "assistant", "content": "hello"}]})
                            + "\n" for i in range(40)))
    workdir = tmp_path / "run"
    _refused(capsys, workdir, run_args(workdir, f"train.data.tokenizer={tokenizer}",
                                       f"train.data.source={data}", "train.eval_every=0"),
             f"chat template of {tokenizer / 'tokenizer_config.json'}", "stopped: the result of "
             "'*' would exceed 16777216 characters")


def test_sweep_run_names_that_are_not_directories(tmp_path, capsys):
    for name in (".", "..", ".hidden"):
        sweep = tmp_path / "sweep.yaml"
        sweep.write_text(json.dumps({"base": str(TINY), "runs": [
            {"name": name, "overrides": ["train.steps=2"]}]}))
        _refused(capsys, tmp_path / "sweep", ["--sweep", str(sweep), "--workdir",
                                              str(tmp_path / "sweep")],
                 f"run name {name!r} is not a usable directory name", main=sweep_main)


def test_rl_task_spaces_and_groups_are_bounded(tmp_path, capsys):
    workdir = tmp_path / "rl"
    base = ["--config", str(RL), "--workdir", str(workdir)]
    _refused(capsys, workdir, [*base, "task.max_operand=100000"], "task.max_operand: must be "
             "<= 399 for arithmetic (its problems are enumerated), got 100000", main=rl_main)
    _refused(capsys, workdir, [*base, "rl.samples_per_prompt=1"], "rl.samples_per_prompt: "
             "rl.advantages=group: a group of 1 sample has advantage 0 and trains nothing",
             main=rl_main)


# Both sides of an unreachable coordinator, in one fresh process (multi-process set-up must
# come before JAX uses a device, which this test process has done).
COORDINATOR_ALONE = r"""
import contextlib, io, json, socket, sys, time
from train.__main__ import main
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # free: nobody listens there
results = []
for process in ("1", "0"):
    err, start = io.StringIO(), time.monotonic()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["--config", sys.argv[1], "--workdir", sys.argv[2] + process,
                         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                         "--process-id", process, "--coordinator-timeout", "1"])
        except SystemExit as exit:  # argparse's error(): the one line, exit 2
            code = exit.code
    results.append([code, err.getvalue(), time.monotonic() - start])
print(json.dumps(results))
"""


def test_an_unreachable_coordinator_is_one_line_after_the_timeout(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    done = subprocess.run([sys.executable, "-c", COORDINATOR_ALONE, str(TINY),
                           str(tmp_path / "run")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (code_1, err_1, seconds_1), (code_0, err_0, seconds_0) = json.loads(done.stdout)
    assert code_1 == code_0 == 2 and seconds_1 < 30 and seconds_0 < 30
    assert err_1.count("\n") == 1 and err_1.startswith("error: process 1 could not reach the "
                                                       "coordinator 127.0.0.1:"), err_1
    assert "within 1 s" in err_1 and "raise --coordinator-timeout" in err_1
    assert err_0.count("\n") == 1 and "process(es) 1 of 2 did not reach" in err_0, err_0
    assert not list(tmp_path.iterdir())


def _rendezvous(processes: list[int], count: int, timeout: float) -> dict[int, str]:
    """Runs `rendezvous` for the given process ids of `count`, each on a thread -> {id: error}."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    errors = {}

    def run(process: int) -> None:
        try:
            distributed.rendezvous(address, count, process, timeout)
        except distributed.DistributedError as err:
            errors[process] = str(err)

    threads = [threading.Thread(target=run, args=(p,)) for p in processes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_the_coordinator_waits_for_every_process_and_names_the_missing():
    assert _rendezvous([2, 0, 1], 3, timeout=60) == {}  # in any order
    errors = _rendezvous([0, 2], 3, timeout=1)
    assert errors[0].startswith("process(es) 1 of 3 did not reach the coordinator 127.0.0.1:")
    assert errors[2].startswith("process 2: the coordinator 127.0.0.1:") and (
        "did not see every process within 1 s") in errors[2]


def _no_batch(trainer, step: int) -> tuple[dict, int]:
    return {}, 64  # the stub step reads no data


def _stub_step(diverges_at: int):
    """A train step without the model: losses 1.0, then non-finite from step `diverges_at` on
    (the skip counters as `train.state.apply_finite_update` keeps them)."""
    def make(trainer):
        def step(state, batch, mask_meta):
            diverged = int(state.step) + 1 >= diverges_at
            skips = state.consecutive_skips + 1 if diverged else state.consecutive_skips * 0
            state = state.replace(step=state.step + 1, skipped=state.skipped + int(diverged),
                                  consecutive_skips=skips)
            loss = jnp.float32(np.nan if diverged else 1.0)
            return state, {"loss": loss, "loss/lm": loss, "consecutive_skips": skips}
        return step
    return make


def _checkpoints(workdir: Path) -> list[str]:
    directory = workdir / "checkpoints"
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


# The smallest model on the arithmetic data: the steps below never run it or read data, so
# only its state is built (a few seconds of tracing).
STUB_RUN = ["model.num_layers=2", "model.layout=SF", "model.d_model=32", "model.window=4",
            "model.head_dim=8", "model.dense_hidden=32", "model.moe.num_experts=4",
            "model.moe.top_k=2", "model.moe.expert_hidden=16", "model.moe.shared_hidden=16",
            "model.moe.num_ep_groups=2", "train.batch_size=4", "train.seq_len=16",
            "train.warmup_steps=0", "train.eval_every=0", "train.progress=false",
            "train.peak_flops=1e9", "train.checkpoint_every=2"]


@pytest.mark.slow
def test_a_run_that_diverges_on_its_last_step_is_not_saved_as_finished(
        tmp_path, capsys, monkeypatch):
    def run(workdir: Path, steps: int, limit: int) -> int:
        return train_main(["--config", str(SFT), "--workdir", str(workdir), *STUB_RUN,
                           f"train.steps={steps}", f"train.max_consecutive_skips={limit}"])

    workdir = tmp_path / "run"
    monkeypatch.setattr(train.loop.Trainer, "next_batch", _no_batch)
    monkeypatch.setattr(train.loop.Trainer, "train_step", _stub_step(diverges_at=2))
    assert run(workdir, steps=4, limit=1) == 2
    _one_line_error(capsys, "the run diverged: 1 consecutive steps had a non-finite loss or "
                    "gradient (up to step 2); stopped without saving its state; no checkpoint "
                    "was saved: lower train.lr and re-run")
    assert _checkpoints(workdir) == []

    monkeypatch.setattr(train.loop.Trainer, "train_step", _stub_step(diverges_at=4))
    assert run(workdir, steps=4, limit=1) == 2  # diverges on the step of a checkpoint
    _one_line_error(capsys, "(up to step 4)", "the checkpoint of step 2 is intact (resuming "
                    "repeats the same steps")
    assert _checkpoints(workdir) == ["2"]  # a re-run resumes at 2: never "nothing to do"

    # A last checkpoint that ended in a skip within the limit, judged under a lower limit.
    workdir = tmp_path / "lenient"
    monkeypatch.setattr(train.loop.Trainer, "train_step", _stub_step(diverges_at=2))
    assert run(workdir, steps=2, limit=2) == 0
    assert _checkpoints(workdir) == ["2"]
    assert run(workdir, steps=2, limit=1) == 2
    _one_line_error(capsys, "the checkpoint of step 2", "ends 1 consecutive non-finite steps: the "
                    "run diverged, it did not finish; move checkpoints/2 away")
