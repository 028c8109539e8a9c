"""Packed rows shuffled within windows of consecutive rows, so that the rows of one long document
land in different batches.

    rows = WindowShuffle(rows, window_size=64, seed=0)

grain's WindowShuffleIterDataset does the same with `index_shuffle`, whose cost grows as the
window shrinks (measured: ~760 us per row for a 64-row window, ~20 us for 1024 rows, on a shared
2-core EPYC), which made it the slowest stage of the pipeline at gpu_1b's 4096-token rows; here a
window is permuted by numpy in one call. The checkpoint state has grain's keys and meaning (the
parent's state at the window's start, the window's index and the position in it; a restore
re-reads the window) plus `order`; a state without it, saved by grain's shuffle, finishes its
window in grain's order, so a checkpoint written before resumes without repeating or skipping a
row.
"""

from __future__ import annotations

import copy
import itertools

import grain
import numpy as np
from grain.experimental import index_shuffle


class WindowShuffle(grain.IterDataset):
    def __init__(self, parent: grain.IterDataset, *, window_size: int, seed: int):
        super().__init__(parent)
        self.window_size, self.seed = window_size, seed

    def __iter__(self) -> grain.DatasetIterator:
        return _WindowShuffleIterator(self._parent.__iter__(), self.window_size, self.seed)


class _WindowShuffleIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, window_size: int, seed: int):
        super().__init__(parent)
        self.window_size, self.seed = window_size, seed
        self.window_index, self.pos, self.window = 0, 0, None
        self.start_state = self._parent.get_state()

    def _fill(self, grains: bool = False) -> None:
        """Reads window `window_index` from the parent's current position and permutes it
        (`grains`: in the order grain's WindowShuffleIterDataset yields it)."""
        self.start_state = copy.deepcopy(self._parent.get_state())
        rows = list(itertools.islice(self._parent, self.window_size))
        if grains:
            seed, top = self.seed + self.window_index, len(rows) - 1
            order = [index_shuffle(i, max_index=top, seed=seed, rounds=4)
                     for i in range(top, -1, -1)]
        else:
            order = np.random.default_rng([self.seed, self.window_index]).permutation(len(rows))
        self.window, self.pos = [rows[i] for i in order], 0

    def __next__(self):
        if self.window is None:
            self._fill()
        elif self.pos == len(self.window):
            self.window_index += 1
            self._fill()
        if self.pos == len(self.window):
            raise StopIteration
        row, self.window[self.pos] = self.window[self.pos], None
        self.pos += 1
        return row

    def get_state(self) -> dict:
        return {"parent_window_start_state": self.start_state, "window_index": self.window_index,
                "pos_in_window": self.pos, "order": "numpy"}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["parent_window_start_state"])
        self.window_index = state["window_index"]
        self._fill(grains="order" not in state)
        self.pos = min(state["pos_in_window"], len(self.window))
        self.window[:self.pos] = [None] * self.pos
