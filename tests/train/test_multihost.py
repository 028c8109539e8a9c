"""Multi-process training (train/parallel/distributed.py).

Fast tests: how the settings are resolved (flags, environment, cluster detection) and the
one-line errors of inconsistent ones; the per-process checkpoint state of single-process runs.

Slow tests, on one machine: two `python -m train` processes with 4 CPU devices each, joined by
`jax.distributed` on 127.0.0.1 with gloo collectives, against one process with 8 CPU devices
running the same config on the same 8-device mesh. The two-process run stops at step 2 and a
second launch resumes it to step 4, so resuming is part of what must match the reference.

What makes the comparison honest: with two processes each reads its own shard of the documents
(train/data/pipeline.py: every 2nd document, from its process index) and contributes the first /
second half of every global batch (`make_array_from_process_local_data`; process 0 owns mesh devices
0-3, which hold the first half of the rows). A plain one-process run would read all documents as
one shard, a different stream. So the one-process reference replaces the trainer's dataset with
the two shard streams (batch size halved) concatenated row-wise (tests/multihost_reference.py,
a test-only patch of `train.loop.make_dataset`): the same global batches. Everything else (model,
mesh, sharded state, checkpoints, evaluation) is the unmodified trainer; the two runs differ only in
where the devices live and which collectives connect them (in-process vs gloo all-reduces, which
sum in another order): metrics agree to float32 round-off, parameters to round-off amplified by
the optimizer (see STATE_RTOL).

Compile time dominates (each process compiles the train step; the persistent compilation cache
cannot help multi-process CPU runs, see train/parallel/distributed.py), so the runs are shared by
the tests through one module fixture. Every process has a deadline and a failing process brings its
peers down at once (they would otherwise wait minutes for it in a collective or a barrier).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from train_helpers import REPO, SMALL_MODEL, SUBPROCESS_XLA_FLAGS, TINY

import train.parallel.distributed as distributed
from model.interop.workdir import Checkpointer, restore_target
from train.__main__ import main as train_main
from train.config import load_run_config
from train.parallel.distributed import (
    DistributedError,
    gather_process_states,
    process_state,
    resolve,
)
from train.state import abstract_state, build_training


STEPS = 4
RESUME_FROM = 2  # the 2-process run stops here and a second launch resumes it
# train_helpers.SMALL_MODEL cut to 2 layers (a dense full-attention layer, a sliding-window MoE
# layer with the SwiGLU clamps) and one MTP head: compile time is most of this file's run time.
MODEL = [
    *SMALL_MODEL, "model.num_layers=2", "model.layout=F+S",
    "model.swiglu_limits=[0, 7.0]", "model.swiglu_limits_shared=[0, 16.0]",
    "model.mtp.num_heads=1",
]
# 8 sequences per step over mesh data=4 x fsdp=2: 4 rows per process; ZeRO-1 (the default)
# shards the optimizer state over `data`, i.e. across the two processes. A constant learning
# rate after warm-up, so a resumed run may raise train.steps without changing the schedule.
# AdamW: Muon under sharding is tests/test_parallel.py's; here it would only add compile time.
RUN = [
    *MODEL, "train.seq_len=16", "train.batch_size=8", "train.warmup_steps=2", "train.optimizer=adamw",
    "train.schedule=constant", f"train.steps={STEPS}", "train.log_every=1",
    f"train.checkpoint_every={RESUME_FROM}", "train.eval_every=4", "train.eval_batches=1",
    "train.progress=false", "train.peak_flops=1e9", "mesh.data=4", "mesh.fsdp=2",
]
LAUNCH_TIMEOUT = 300  # seconds for one (pair of) process(es), start-up and compilation included
# Metrics agree to float32 round-off (observed: step 1 bit-identical, later steps within ~1e-6
# relative). Parameters and optimizer state drift further apart in relative terms: the all-reduces
# sum in another order, and Adam's m/sqrt(v) amplifies last-bit differences in small gradient
# components (observed after 4 steps with Muon: <= 3e-4 of each tensor's norm, everywhere; a
# wrong batch or a lost update moves whole tensors by far more).
METRICS_RTOL = 1e-5
STATE_RTOL = 2e-3

# The one-process reference: `python -m train` whose train stream is the two processes' shard
# streams, each with half the batch, concatenated row-wise (a test-only patch of
# `train.loop.make_dataset`, run as a module so that its failures name the values).
REFERENCE = Path(__file__).resolve().parents[1] / "multihost_reference.py"

NOISE = ("Involuntary full rematerialization", "[Gloo]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"))
           and "proxy" not in k.lower()}  # gRPC to 127.0.0.1 must not go through a proxy
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {SUBPROCESS_XLA_FLAGS}",
               JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return env


def log_tail(path: Path, lines: int = 25) -> str:
    text = [line for line in path.read_text(errors="replace").splitlines()
            if not any(n in line for n in NOISE)]
    return "\n".join(text[-lines:])


def run_processes(commands: list[list[str]], env: dict[str, str], logs: list[Path],
                  timeout: float = LAUNCH_TIMEOUT) -> None:
    """Runs `commands` concurrently; returns when all exited 0. If one fails or the deadline
    passes, kills all of them (SIGKILL: the trainer and JAX's preemption notifier catch
    SIGTERM) and fails with the end of every log."""
    procs: list[subprocess.Popen] = []
    reason = None
    try:
        for command, log in zip(commands, logs):
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                reason = "a process failed"  # its peers would wait for it in a collective
                break
            if time.monotonic() > deadline:
                reason = f"timed out after {timeout:.0f}s"
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if reason or any(p.returncode for p in procs):
        report = "\n".join(f"--- process {i} (exit {p.returncode}), {log}:\n{log_tail(log)}"
                           for i, (p, log) in enumerate(zip(procs, logs)))
        pytest.fail(f"{reason or 'a process failed'}\n{report}", pytrace=False)


def train_command(workdir: Path, *args: str) -> list[str]:
    return ["--config", str(TINY), "--workdir", str(workdir), *args]


def two_processes(workdir: Path, cache: Path, *overrides: str) -> list[Path]:
    """`python -m train` as processes 0 and 1 of a 2-process job, 4 CPU devices each, with
    train.xla_cache_dir=`cache` (which train/parallel/distributed.py must leave unused on CPU)."""
    coordinator = f"127.0.0.1:{free_port()}"
    commands = [[sys.executable, "-m", "train",
                 *train_command(workdir, "--coordinator", coordinator, "--num-processes", "2",
                                "--process-id", str(i), *RUN, f"train.xla_cache_dir={cache}",
                                *overrides)] for i in range(2)]
    logs = [workdir.parent / f"{workdir.name}.process{i}.log" for i in range(2)]
    run_processes(commands, child_env(4), logs)
    return logs


def one_process(workdir: Path) -> Path:
    """The reference: one process with 8 CPU devices reading the 2-process global batches."""
    command = [sys.executable, str(REFERENCE),
               *train_command(workdir, "--num-processes", "1", *RUN,
                              f"train.xla_cache_dir={jax.config.jax_compilation_cache_dir or ''}")]
    log = workdir.parent / f"{workdir.name}.log"
    run_processes([command], child_env(8), [log])
    return log


def metrics(workdir: Path) -> dict[int, dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def restore(workdir: Path, step: int):
    """(state, data state) of a checkpoint, restored into this process's first device (orbax
    needs target shardings for a checkpoint written on another topology)."""
    run = load_run_config(TINY, RUN)
    target = restore_target(abstract_state(build_training(run), run.train.seed),
                            jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    checkpoints = Checkpointer(workdir / "checkpoints", keep=100)
    try:
        return checkpoints.restore(step, target)
    finally:
        checkpoints.close()


def assert_trees_close(a, b, rtol=STATE_RTOL):
    """Every leaf: ||a - b|| <= rtol * ||b|| (Frobenius norms), and equal shapes."""
    leaves_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for (path, x), y in zip(leaves_a, leaves_b):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape, jax.tree_util.keystr(path)
        difference, size = np.linalg.norm(x - y), np.linalg.norm(y)
        assert difference <= rtol * size + 1e-12, (
            f"{jax.tree_util.keystr(path)}: differs by {difference:.3g} (norm {size:.3g})")


# ---- settings ---------------------------------------------------------------------------------


@pytest.fixture
def no_cluster(monkeypatch):
    """No JAX_* settings in the environment and no cluster detected."""
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(distributed, "detected_cluster", lambda: None)
    return monkeypatch


def test_single_process_by_default(no_cluster):
    def refuse(*args, **kwargs):
        raise AssertionError("jax.distributed.initialize must not be called")

    no_cluster.setattr(jax.distributed, "initialize", refuse)
    assert resolve(None, None, None) == (None, None, None, False)
    assert distributed.initialize() is False
    assert distributed.initialize(None, 1, None) is False  # one process: nothing to start


def test_settings_from_flags_then_environment(no_cluster):
    assert resolve("10.0.0.1:1234", 2, 1) == ("10.0.0.1:1234", 2, 1, True)
    no_cluster.setenv("JAX_COORDINATOR_ADDRESS", "head:99")
    no_cluster.setenv("JAX_NUM_PROCESSES", "4")
    no_cluster.setenv("JAX_PROCESS_ID", "3")
    assert resolve(None, None, None) == ("head:99", 4, 3, True)
    assert resolve("other:1", None, 0) == ("other:1", 4, 0, True)  # flags win


def test_cluster_detection(no_cluster):
    no_cluster.setattr(distributed, "detected_cluster", lambda: ("slurm", 4))
    assert resolve(None, None, None) == (None, None, None, True)  # JAX reads SLURM_* itself
    assert resolve(None, None, 2) == (None, None, 2, True)
    assert resolve(None, 1, None)[3] is False  # --num-processes 1 opts out
    no_cluster.setattr(distributed, "detected_cluster", lambda: ("slurm", 1))
    assert resolve(None, None, None)[3] is False  # a one-task allocation


@pytest.mark.parametrize("flags, env, message", [
    (("h:1", 2, 2), {}, "process id 2 (--process-id) must be below the number of processes 2 "
                        "(--num-processes)"),
    ((None, None, 5), {"JAX_NUM_PROCESSES": "2"}, "process id 5 (--process-id) must be below "
                                                  "the number of processes 2 (JAX_NUM_PROCESSES)"),
    (("h:1", 2, -1), {}, "--process-id must be >= 0, got -1"),
    (("h:1", 0, 0), {}, "--num-processes must be >= 1, got 0"),
    (("nohost", 2, 0), {}, "--coordinator: expected HOST:PORT"),
    (("h:99999", 2, 0), {}, "--coordinator: expected HOST:PORT"),
    ((None, None, None), {"JAX_COORDINATOR_ADDRESS": "h"}, "JAX_COORDINATOR_ADDRESS: expected"),
    ((None, None, None), {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES must be an integer"),
    (("h:1", None, None), {}, "also set --num-processes (or JAX_NUM_PROCESSES) and --process-id "
                              "(or JAX_PROCESS_ID); no cluster"),
    ((None, 2, 0), {}, "also set --coordinator (or JAX_COORDINATOR_ADDRESS)"),
])
def test_inconsistent_settings(no_cluster, flags, env, message):
    for name, value in env.items():
        no_cluster.setenv(name, value)
    with pytest.raises(DistributedError) as err:
        resolve(*flags)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_initialize_after_devices_are_in_use_is_an_error(no_cluster):
    jax.devices()  # this process's backend is up
    with pytest.raises(DistributedError, match="before JAX uses any device"):
        distributed.initialize("127.0.0.1:1", 2, 0)


def test_cli_reports_inconsistent_flags(no_cluster, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_main(["--config", str(TINY), "--workdir", str(tmp_path), "--coordinator",
                    "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: process id 2") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())  # nothing ran


def test_process_states_of_one_process():
    state = {"pipeline": {"shard_index": 0}, "grain": [1, 2]}
    assert gather_process_states(state) is state  # single-process checkpoints keep their format
    assert process_state(state) is state
    with pytest.raises(DistributedError, match="written by 2 processes, this run has 1"):
        process_state({"processes": [state, state]})


# ---- two processes -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Workdirs of the runs: `one` (1 process, 8 devices, straight to step 4) and `two` (2
    processes x 4 devices, stopped at step 2 and resumed to step 4: the resume is part of the
    run compared with `one`), the resumed launch's logs and the compilation-cache directory."""
    root = tmp_path_factory.mktemp("multihost")
    one_process(root / "one")
    two_processes(root / "two", root / "xla-cache", f"train.steps={RESUME_FROM}")
    logs = two_processes(root / "two", root / "xla-cache")
    return {"one": root / "one", "two": root / "two", "two_logs": logs,
            "cache": root / "xla-cache"}


@pytest.mark.slow
def test_two_processes_train_and_resume_like_one(runs):
    one, two = metrics(runs["one"]), metrics(runs["two"])
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    for step in one:
        for key in ("loss", "loss/lm", "grad_norm", "tokens_seen"):
            np.testing.assert_allclose(two[step][key], one[step][key], rtol=METRICS_RTOL,
                                       err_msg=f"{key} at step {step}")
    np.testing.assert_allclose(two[STEPS]["eval/loss"], one[STEPS]["eval/loss"], rtol=METRICS_RTOL)

    # Both processes wrote one checkpoint; it restores (here into one device) to the
    # reference's parameters and optimizer state.
    state_two, data_two = restore(runs["two"], STEPS)
    state_one, data_one = restore(runs["one"], STEPS)
    assert int(state_two.step) == int(state_one.step) == STEPS
    assert_trees_close(state_two.params, state_one.params)
    assert_trees_close(state_two.opt_state, state_one.opt_state)
    # ... with each process's own data position (each reads its own shard).
    shards = [s["pipeline"] for s in data_two["processes"]]
    assert [(s["shard_index"], s["shard_count"], s["batch_size"]) for s in shards] == \
        [(0, 2, 4), (1, 2, 4)]
    # The reference read the same two shard streams (its patched dataset's state), one process.
    assert [(s["pipeline"]["shard_index"], s["pipeline"]["shard_count"],
             s["pipeline"]["batch_size"]) for s in data_one["shards"]] == [(0, 2, 4), (1, 2, 4)]

    # Only process 0 reports; the second launch resumed from the first one's checkpoint.
    first, second = (log.read_text() for log in runs["two_logs"])
    assert f"finished at step {STEPS} (started at {RESUME_FROM})" in first
    assert "finished at step" not in second
    # Had process 0 loaded the step from the persistent cache while process 1 (whose cache keys
    # differ on CPU) compiled it, they would have met gloo's ~30 s limit; the cache stays off.
    cache = runs["cache"]
    assert not cache.exists() or not [p for p in cache.rglob("*") if p.is_file()]
