"""What a training run leaves where people look: plain progress lines (stdout is not a terminal
under pytest) showing the main head's loss as metrics.jsonl holds it, notices whatever
`train.progress` says, the start-up line, `WORKDIR/config.yaml` that `--config` reads back, and
the same metrics in an offline Weights & Biases run that a resumed workdir continues. Without the
wandb package a run asking for it stops at once, naming the extra."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import sys

import jax
import pytest
from train_helpers import SMALL_MODEL, TINY, small_run

from model.config.cli import human
from model.summary import count_params
from rl.__main__ import main as rl_main
from train.__main__ import main as train_main
from train.config import load_run_config
from train.loop import train
from train.telemetry.metrics import read_metrics

REPO_RL = TINY.parent / "rl_arith.yaml"


def wandb_records(path) -> list:
    """The records of a W&B transaction log (`run-<id>.wandb`): a 7-byte header (":W&B", magic,
    version), then LevelDB's log format, 32 KiB blocks of chunks [crc32, length u16, type u8]
    (1 full, 2 first, 3 middle, 4 last), each record a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", raw[:7]
    records, chunks, pos, block = [], [], 7, 32768
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        chunks.append(raw[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(b"".join(chunks)))
            chunks = []
    return records


def wandb_history(run_dir) -> tuple[str, str, list[dict]]:
    """(run id, display name, the logged rows) of one offline run directory."""
    [log] = run_dir.glob("run-*.wandb")
    records = wandb_records(log)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    # An item names its metric by `key` or by `nested_key` (its path), as W&B's core chooses.
    rows = [{item.key or ".".join(item.nested_key): json.loads(item.value_json)
             for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    return run.run_id, run.display_name, rows


@pytest.mark.slow
def test_a_run_prints_plain_lines_writes_its_config_and_logs_to_wandb(tmp_path, monkeypatch,
                                                                       capsys):
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = small_run("train.steps=6", "train.log_every=2", "train.checkpoint_every=2",
                    "train.eval_every=4", "train.eval_batches=1", "train.progress=true",
                    "train.wandb.project=stepjax-tests", vocab=4096)
    workdir = tmp_path / "run"
    assert train(run, workdir, stop_after=3).last_step == 3
    first = capsys.readouterr().out
    assert load_run_config(workdir / "config.yaml") == run
    quiet = dataclasses.replace(run, train=dataclasses.replace(run.train, progress=False))
    assert train(quiet, workdir).last_step == 6  # resumed, without progress lines
    second = capsys.readouterr().out
    assert load_run_config(workdir / "config.yaml") == quiet  # rewritten at the resume
    records = {r["step"]: r for r in read_metrics(workdir / "metrics.jsonl")}
    assert sorted(records) == [2, 4, 6]

    counts = count_params(run.model)["with_mtp"]
    devices = jax.device_count()
    startup = (f"train: {human(counts['total'])} parameters, {human(counts['active'])} active "
               f"per token (MTP heads included); {devices} cpu device{'s' * (devices > 1)}, mesh "
               f"{'data=%d' % devices if devices > 1 else 'of one device'}; "
               "64 tokens per step (4 x 16)")
    assert "\r" not in first + second
    lines = first.splitlines()
    assert lines[0] == startup and re.fullmatch(r"compiled and ran the first train step in "
                                                r"[\d.]+s", lines[1]), lines
    # One line at step 2 (log_every), one where the run stopped, with the main head's loss.
    assert [line.split(" [")[0] for line in lines[2:]] == ["train 2/6", "train 3/6"], lines
    assert lines[2].endswith(f"loss/lm={records[2]['loss/lm']:.4f}]"), (lines[2], records[2])
    # train.progress=false: no progress lines, every notice all the same.
    assert second.splitlines()[0] == startup
    assert second.splitlines()[2:] == [f"step {s}: held-out loss {records[s]['eval/loss']:.4f}"
                                       for s in (4, 6)], second

    run_id = (workdir / "wandb_run_id").read_text().strip()
    runs = sorted((workdir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # one per invocation, both the same W&B run
    logged = {}
    for run_dir in runs:
        got_id, name, rows = wandb_history(run_dir)
        assert (got_id, name) == (run_id, "run")
        logged.update({row["_step"]: row for row in rows})
    assert sorted(logged) == [2, 4, 6]
    for step, record in records.items():
        for key in ("loss", "loss/lm", "grad_norm", "lr"):
            assert logged[step][key] == record[key], (step, key)
    assert logged[6]["eval/loss"] == records[6]["eval/loss"]


@pytest.mark.parametrize("main, argv", [
    (train_main, ["--config", str(TINY), *SMALL_MODEL, "train.wandb.project=p"]),
    (rl_main, ["--config", str(REPO_RL), "rl.wandb.project=p"]),
])
def test_without_the_wandb_package_a_run_asking_for_it_stops_first(tmp_path, capsys,
                                                                    monkeypatch, main, argv):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    workdir = tmp_path / "run"
    assert main([*argv, "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err.strip()
    section = "train" if main is train_main else "rl"
    assert err == (f"error: {section}.wandb.project: logging to Weights & Biases needs the wandb "
                   "package: pip install 'stepjax[wandb]' (or leave the field empty)")
    assert not workdir.exists()
