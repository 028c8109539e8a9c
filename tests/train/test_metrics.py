"""train.telemetry.metrics (the async writer) and the train.plot CLI."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from train.experiments.plot import main as plot_main
from train.experiments.plot import stage_records
from train.telemetry.metrics import MetricsWriter, read_metrics

ROOT = Path(__file__).resolve().parents[2]


def lines(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_round_trip_nan_and_histograms(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(1, {"loss": jnp.float32(2.5), "lr": 1e-3, "skipped_steps": jnp.int32(0),
                         "grad_norm": jnp.float32(np.nan), "mfu": np.float32(np.inf),
                         "moe_hist/layer1/load": jnp.array([0.1, 0.2, np.nan, 0.7])})
        writer.write(2, {"loss": jnp.array([2.0])})
    records = lines(tmp_path)  # strict json: NaN/Infinity would not parse as null
    assert records == [
        {"step": 1, "loss": 2.5, "lr": 1e-3, "skipped_steps": 0.0, "grad_norm": None,
         "mfu": None},
        {"step": 2, "loss": 2.0},
    ]
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def read_events(logdir: Path) -> list:
    """TFRecord framing: u64 length, u32 crc, payload, u32 crc; payload = Event proto."""
    from tensorboardX.proto.event_pb2 import Event
    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        while data:
            length = int.from_bytes(data[:8], "little")
            events.append(Event.FromString(data[12:12 + length]))
            data = data[16 + length:]
    return events


def test_histograms_reach_tensorboard(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(3, {"loss": 1.0, "moe_hist/layer1/load": np.arange(4.0)})
    values = [(e.step, v) for e in read_events(tmp_path / "tensorboard") for v in e.summary.value]
    scalars = {v.tag: (step, v.simple_value) for step, v in values if v.HasField("simple_value")}
    hists = {v.tag: (step, v.histo) for step, v in values if v.HasField("histo")}
    assert scalars == {"loss": (3, 1.0)}
    assert set(hists) == {"moe_hist/layer1/load"}
    assert hists["moe_hist/layer1/load"][0] == 3 and hists["moe_hist/layer1/load"][1].num == 4


def test_texts_reach_the_file_and_tensorboard(tmp_path):
    """A string value (a generated sample) is kept as text, beside the numbers."""
    text = "def main():\n    return"
    with MetricsWriter(tmp_path) as writer:
        writer.write(5, {"loss": 2.0, "samples/0": text})
    assert lines(tmp_path) == [{"step": 5, "loss": 2.0, "samples/0": text}]
    texts = [(v.tag, e.step, v.tensor.string_val) for e in read_events(tmp_path / "tensorboard")
             for v in e.summary.value if v.HasField("tensor")]
    assert texts == [("samples/0/text_summary", 5, [text.encode()])]


def test_background_error_surfaces(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write(1, {"loss": object()})  # not a number: fails in the thread
    with pytest.raises(RuntimeError, match="metrics writer failed"):
        writer.flush()
    writer.write(2, {"loss": 1.0})  # the writer keeps going after reporting
    writer.write(3, {"bad": [1.0, "x"]})
    with pytest.raises(RuntimeError, match="metrics writer failed"):
        writer.close()
    assert lines(tmp_path) == [{"step": 2, "loss": 1.0}]
    with pytest.raises(RuntimeError, match="after close"):
        writer.write(4, {})


def test_error_raised_by_next_write(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write(1, {"loss": None})
    writer._queue.join()  # let the thread fail without raising here
    with pytest.raises(RuntimeError, match="metrics writer failed"):
        writer.write(2, {"loss": 1.0})
    writer.close()


def test_truncate_after_and_resume_appends(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        for step in (10, 20, 30):
            writer.write(step, {"loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 40, "lo')  # a line cut short by a crash
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.truncate_after(20)
        assert [r["step"] for r in lines(tmp_path)] == [10, 20]
        writer.write(30, {"loss": 0.5})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (10, 10.0), (20, 20.0), (30, 0.5)]
    assert not list(tmp_path.glob(".metrics.jsonl.*"))  # no temporary file left behind


def test_truncated_metrics_file_keeps_the_umask_mode(tmp_path):
    previous = os.umask(0o022)
    try:
        with MetricsWriter(tmp_path, tensorboard=False) as writer:
            writer.write(1, {"loss": 1.0})
            writer.truncate_after(0)  # replaced by a temporary file
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "metrics.jsonl").stat().st_mode) == 0o644


def write_run(workdir: Path, steps=5):
    with MetricsWriter(workdir, tensorboard=False) as writer:
        for step in range(1, steps + 1):
            writer.write(step, {
                "loss": 5.0 / step, "loss/lm": 4.0 / step, "loss/mtp": 1.0 / step,
                "loss/balance": 1e-3, "lr": 1e-3 * step, "grad_norm": 1.0 + step,
                "tokens_per_sec": 1000.0, "moe/act_rms_max_over_median": 1.5,
                "moe/layer1/act_rms_max_over_median": 1.5, "moe/routing_confidence": 0.6,
                "mfu": float("nan")})


def test_plot_writes_png(tmp_path, capsys):
    write_run(tmp_path)
    assert plot_main(["--workdir", str(tmp_path)]) == 0
    png = tmp_path / "metrics.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "other.png"
    assert plot_main(["--workdir", str(tmp_path), "--out", str(out)]) == 0
    assert out.stat().st_size > 0


def test_recipe_stages_share_one_step_axis(tmp_path, capsys):
    write_run(tmp_path / "stages" / "01-pre", steps=5)
    write_run(tmp_path / "stages" / "02-long", steps=3)
    (tmp_path / "stages" / "03-not-started").mkdir()
    records, boundaries = stage_records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert records[5]["loss"] == 5.0  # step 1 of the second stage
    assert boundaries == [(5, "02-long")]
    assert plot_main(["--workdir", str(tmp_path)]) == 0
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("content", [None, "", '{"step": 1, "unknown": 2}\n'])
def test_plot_errors_are_one_line(tmp_path, capsys, content):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        plot_main(["--workdir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "metrics.png").exists()


def test_plot_cli_help_and_missing_file(tmp_path):
    run = lambda *args: subprocess.run([sys.executable, "-m", "train.plot", *args], cwd=ROOT,
                                       capture_output=True, text=True, timeout=60)
    assert run("--help").returncode == 0
    result = run("--workdir", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_tensorboard_reads_the_event_files(tmp_path):
    # What `tensorboard --logdir WORKDIR/tensorboard` shows (the `tensorboard` extra): its own
    # reader, and its command line's summary of the same directory.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path) as writer:
        writer.write(3, {"loss/lm": 1.5, "moe_hist/layer1/load": np.arange(4.0)})
        writer.write(6, {"loss/lm": 1.25})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss/lm")] == [(3, 1.5), (6, 1.25)]
    assert events.Tags()["histograms"] == ["moe_hist/layer1/load"]
    tensorboard = Path(sys.executable).with_name("tensorboard")
    inspected = subprocess.run([str(tensorboard), "--inspect", "--logdir",
                                str(tmp_path / "tensorboard")],
                               capture_output=True, text=True, timeout=120)
    assert inspected.returncode == 0 and "loss/lm" in inspected.stdout, inspected.stderr
