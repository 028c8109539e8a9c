"""Training throughput over completed steps only.

The loop dispatches step n+1 before it waits for step n (asynchronous dispatch), so the time
between two log points is not the time their steps took: right after the first call (which
compiles) or after an evaluation, nothing is queued, and timing the dispatch of the next step
alone gave rates ~100x too high. `CompletedSteps` counts a step's tokens when the loop has seen
that step finish, and divides by the wall time between such sightings.
"""

import time


class CompletedSteps:
    def __init__(self):
        self.restart()

    def restart(self) -> None:
        """Nothing is running now (e.g. after the compiling first step): time from here."""
        self._start = self._last = time.perf_counter()
        self._tokens = 0

    def finished(self, tokens: int) -> None:
        """A step dispatched after the last restart has just been seen complete."""
        self._tokens += tokens
        self._last = time.perf_counter()

    def tokens_per_sec(self) -> float | None:
        """Rate over the steps finished since the previous call (or restart), which starts the
        next interval; None if no step finished in between."""
        if not self._tokens:
            return None
        rate = self._tokens / (self._last - self._start)
        self._start, self._tokens = self._last, 0
        return rate
