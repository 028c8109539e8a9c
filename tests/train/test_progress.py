"""What a run prints (train/telemetry/progress.py): a redrawn bar only on a terminal, plain lines
without carriage returns anywhere else, notices whatever `show` says, nothing on processes other
than the first."""

from __future__ import annotations

import io
import sys

import pytest

from train.telemetry.progress import Progress, on_terminal


class Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.fixture
def streams(monkeypatch):
    """Redirects stdout and stderr to streams that say whether they are terminals."""
    def use(out_tty: bool, err_tty: bool) -> tuple[Stream, Stream]:
        out, err = Stream(out_tty), Stream(err_tty)
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        return out, err
    return use


def drive(progress: Progress) -> None:
    """Ten steps, logging every 4, with a notice after step 4; stops at step 10 of 12."""
    with progress:
        for step in range(1, 11):
            progress.update(step, {"loss/lm": 10.0 / step, **({"tok/s": 12345.0} if step == 3
                                                                 else {})})
            if step == 4:
                progress.notice("step 4: held-out loss 2.5000")


@pytest.mark.parametrize("out_tty, err_tty", [(False, False), (False, True), (True, False)])
def test_off_a_terminal_one_plain_line_per_log_interval(streams, out_tty, err_tty):
    out, err = streams(out_tty, err_tty)
    assert not on_terminal()
    drive(Progress(12, 0, every=4))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and err.getvalue() == ""
    # Steps 4 and 8, then the step the run stopped at; each with the values shown then.
    assert [line.split(" [")[0] for line in lines] == [
        "train 4/12", "step 4: held-out loss 2.5000", "train 8/12", "train 10/12"]
    assert lines[0].endswith("loss/lm=2.5000, tok/s=12.3k]")
    assert lines[2].endswith("loss/lm=1.2500, tok/s=12.3k]")
    assert lines[3].endswith("loss/lm=1.0000, tok/s=12.3k]")


def test_on_a_terminal_the_bar_is_redrawn_on_stderr(streams):
    out, err = streams(True, True)
    assert on_terminal()
    drive(Progress(12, 0, every=4))
    assert out.getvalue() == ""
    frames = err.getvalue().split("\r")
    assert "step 4: held-out loss 2.5000" in err.getvalue()
    assert any("10/12" in frame and "loss/lm=1.0000" in frame and "tok/s=12.3k" in frame
               for frame in frames)


@pytest.mark.parametrize("tty", [True, False])
def test_without_progress_only_the_notices_print(streams, tty):
    out, err = streams(tty, tty)
    drive(Progress(12, 0, every=4, show=False))
    assert out.getvalue() == "step 4: held-out loss 2.5000\n" and err.getvalue() == ""


@pytest.mark.parametrize("tty", [True, False])
def test_processes_other_than_the_first_print_nothing(streams, tty):
    out, err = streams(tty, tty)
    drive(Progress(12, 0, every=4, lead=False))
    assert out.getvalue() == "" and err.getvalue() == ""


def test_a_resumed_run_counts_from_its_first_step(streams):
    out, _ = streams(False, False)
    with Progress(12, 8, every=4) as progress:
        progress.update(9, {"loss/lm": 1.0})
        progress.update(12, {"loss/lm": 0.5})
    assert out.getvalue().splitlines()[0].startswith("train 12/12 ")
