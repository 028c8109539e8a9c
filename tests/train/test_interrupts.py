"""Ctrl-C during the first compile of `python -m train`: the first SIGINT is acknowledged at
once, a second exits at once with status 130, the checkpoint saved before stays intact and the
next run resumes from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from train_helpers import REPO, SMALL_MODEL, TINY

from model.interop.workdir import Checkpointer
from train.config import load_run_config
from train.loop import train

OVERRIDES = [*SMALL_MODEL, "model.vocab_size=4096", "train.seq_len=16", "train.batch_size=4",
             "train.warmup_steps=2", "train.steps=4", "train.peak_flops=1e9", "train.eval_every=0"]
ACK = "received SIGINT: will save a checkpoint and stop after the current step; " \
      "press Ctrl-C again to exit now"


class Output:
    """Collects a subprocess's stdout and stderr (merged) as they come."""

    def __init__(self, process: subprocess.Popen):
        self.text = ""
        threading.Thread(target=self._read, args=(process.stdout,), daemon=True).start()

    def _read(self, stream) -> None:
        while chunk := os.read(stream.fileno(), 4096):
            self.text += chunk.decode(errors="replace")

    def wait_for(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            assert time.monotonic() < deadline, f"no {needle!r} in {self.text!r}"
            time.sleep(0.05)


@pytest.mark.slow
def test_ctrl_c_during_compile_is_acknowledged_and_a_second_exits_now(tmp_path):
    run = load_run_config(TINY, [*OVERRIDES, "train.progress=false"])
    assert train(run, tmp_path, stop_after=2).last_step == 2  # the checkpoint to keep
    # A fresh compilation cache and XLA's default optimisation: the compile takes many seconds.
    command = [sys.executable, "-m", "train", "--config", str(TINY), "--workdir", str(tmp_path),
               *OVERRIDES, f"train.xla_cache_dir={tmp_path / 'fresh-cache'}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": ""}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    try:
        output = Output(process)
        output.wait_for("train:", timeout=300)  # the start-up line: the first step compiles next
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        output.wait_for(ACK, timeout=5)
        process.send_signal(signal.SIGINT)
        start = time.monotonic()
        assert process.wait(timeout=10) == 130
        assert time.monotonic() - start < 5
        assert "compiled and ran the first train step" not in output.text  # it was compiling
        assert "Traceback" not in output.text
    finally:
        process.kill()
        process.wait()
    checkpoints = Checkpointer(tmp_path / "checkpoints", keep=100)
    assert checkpoints.all_steps() == [2]
    checkpoints.close()
    resumed = train(run, tmp_path)
    assert (resumed.first_step, resumed.last_step, resumed.interrupted) == (2, 4, False)
