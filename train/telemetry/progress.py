"""What a run prints while it runs (`python -m train`, `python -m rl`): its progress and its
notices.

    with Progress(total=240, initial=0, every=10, desc="train") as progress:
        progress.update(10, {"loss/lm": 4.12, "tok/s": 2100.0})
        progress.notice("step 80: held-out loss 4.5512")

Where the output goes decides its form:
- on a terminal (stdout and stderr both): tqdm's bar on stderr, redrawn in place;
- anywhere else (a log file, a pipe, a batch job's output): one plain line on stdout per `every`
  steps and at the last step, `train 10/240 [00:41<06:10, 4.10s/step, loss/lm=4.1200, tok/s=2.1k]`,
  with no carriage returns;
- `show=False` (`train.progress=false`): neither.
Notices (the compile time, held-out evaluations, loss spikes) print in every case, flushed at
once; `lead=False` (every process of a multi-process run but the first) prints nothing at all.
"""

from __future__ import annotations

import sys
import time
from typing import Mapping

from tqdm import tqdm

# The plain line: tqdm's own fields, without the bar.
LINE_FORMAT = "{desc} {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def _si(value: float) -> str:
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"


def shown(name: str, value: float) -> str:
    """A progress value as shown: rates with an SI prefix (`12.3k`), anything else to 4
    decimals."""
    return _si(float(value)) if name.endswith("/s") else f"{float(value):.4f}"


def on_terminal() -> bool:
    """Both output streams are terminals: a redrawn bar is read there, not stored."""
    return all(stream is not None and stream.isatty() for stream in (sys.stdout, sys.stderr))


class Progress:
    """A run's progress display and notices, in the form its output stream calls for (above)."""

    def __init__(self, total: int, initial: int = 0, *, every: int = 1, desc: str = "train",
                 unit: str = "step", show: bool = True, lead: bool = True,
                 live: bool | None = None):
        """`every`: steps between plain lines; `live`: draw the bar (default: `on_terminal()`)."""
        self.total, self.initial, self.every, self.lead = total, initial, every, lead
        self.desc, self.unit = desc, unit
        live = on_terminal() if live is None else live
        self._bar = tqdm(total=total, initial=initial, file=sys.stderr, unit=unit,
                         dynamic_ncols=True, desc=desc) if lead and show and live else None
        self._lines = lead and show and not live
        self._values: dict[str, str] = {}
        self._start = time.perf_counter()
        self._step = self._printed = initial
        # The rate (and so the time left) counts from the first step seen done, which leaves
        # out the compile before it.
        self._first: tuple[int, float] | None = None

    def update(self, step: int, values: Mapping[str, float] | None = None) -> None:
        """`step`: steps completed so far (absolute); `values` (e.g. that step's loss) replace
        the ones shown before, the others stay."""
        self._values.update({name: shown(name, v) for name, v in (values or {}).items()})
        self._step = step
        if self._first is None:
            self._first = (step, time.perf_counter())
        if self._bar is not None:
            self._bar.set_postfix(self._values, refresh=False)
            self._bar.update(step - self._bar.n)
        elif self._lines and step != self._printed and (step % self.every == 0
                                                         or step == self.total):
            self._print_line()

    def notice(self, message: str) -> None:
        """A line that always prints (above the bar when there is one)."""
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        elif self.lead:
            print(message, flush=True)

    def line(self) -> str:
        """The plain line of the current step."""
        postfix = ", ".join(f"{name}={value}" for name, value in self._values.items())
        now = time.perf_counter()
        rate = None
        if self._first is not None and self._step > self._first[0] and now > self._first[1]:
            rate = (self._step - self._first[0]) / (now - self._first[1])
        return tqdm.format_meter(self._step, self.total, now - self._start, prefix=self.desc,
                                 unit=self.unit, postfix=postfix, rate=rate,
                                 initial=self.initial, bar_format=LINE_FORMAT)

    def _print_line(self) -> None:
        self._printed = self._step
        print(self.line(), flush=True)

    def close(self) -> None:
        """Ends the bar; plain lines end with the step the run stopped at, if not yet shown."""
        if self._bar is not None:
            self._bar.close()
        elif self._lines and self._step != self._printed:
            self._print_line()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
