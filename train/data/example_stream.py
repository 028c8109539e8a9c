"""A source's examples in order, read and encoded ahead in this process or in grain worker
processes (`train.data.num_workers`), with a position that does not depend on how many.

    examples = records.map(ReadExample(...))           # a grain MapDataset, one per record
    stream = ExampleStream(examples, read_options, num_workers=4)
    rows = pack(stream, seq_len)                       # packing, shuffling, batching: here

Only the one-to-one work (a record read, a document tokenized) goes to the workers; grain's
`mp_prefetch` deals the examples out round-robin and interleaves them back, so the stream is
the examples' own order whatever the worker count. The state is the number of examples taken
(grain's own in-process state has the same form): a checkpoint resumes exactly with another
`num_workers`, or none. (Running the whole pipeline in each worker, packing its own slice of
the records, would make both the stream and the state depend on the count; grain's
`mp_prefetch` documents this.)
"""

from __future__ import annotations

import atexit
import weakref

import grain
import numpy as np
from absl import flags

CHUNK = 64  # examples a worker sends at a time
LENGTHS = "lengths"  # a chunk's example lengths, next to its concatenated features
# Streams with worker processes, closed (their grain iterators released) before the interpreter
# tears its modules down: a grain iterator left to its finaliser then prints "Exception
# ignored" tracebacks at exit.
_WITH_WORKERS: weakref.WeakSet = weakref.WeakSet()
atexit.register(lambda: [stream.close() for stream in list(_WITH_WORKERS)])


class ExampleStream(grain.IterDataset):
    """`examples` (a MapDataset) from its start, or from any example; see the module doc."""

    def __init__(self, examples: grain.MapDataset, read_options: grain.ReadOptions,
                 num_workers: int):
        super().__init__()
        self.examples, self.read_options, self.num_workers = examples, read_options, num_workers

    def __iter__(self) -> grain.DatasetIterator:
        return _ExampleStreamIterator(self)

    def open(self, start: int) -> grain.DatasetIterator:
        """An iterator over the examples from number `start` on: one by one in this process,
        in lists of CHUNK from worker processes (one transfer per list, not per array)."""
        examples = self.examples[start:] if start else self.examples
        if not self.num_workers:
            return iter(examples.to_iter_dataset(self.read_options))
        # grain's worker processes read absl flags; parse them (to defaults) if nobody did.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        chunks = grain.MapDataset.range(-(-len(examples) // CHUNK)).map(_Chunk(examples))
        options = grain.MultiprocessingOptions(num_workers=self.num_workers)
        return iter(chunks.to_iter_dataset(self.read_options).mp_prefetch(options))


class _Chunk:
    """Chunk number c -> the examples c * CHUNK ... of `examples` (picklable, for workers)."""

    def __init__(self, examples: grain.MapDataset):
        self.examples = examples

    def __call__(self, c: int) -> dict:
        """The chunk's examples concatenated, feature by feature, with their lengths: a few
        arrays to move between processes, however many examples."""
        chunk = [self.examples[i]
                 for i in range(c * CHUNK, min((c + 1) * CHUNK, len(self.examples)))]
        joined = {k: np.concatenate([e[k] for e in chunk]) for k in chunk[0]}
        return {**joined, LENGTHS: np.array([len(e["tokens"]) for e in chunk], np.int64)}


def _split(chunk: dict) -> list[dict]:
    """A chunk back into its examples (in this process's memory, not grain's shared memory:
    the packer keeps an example across rows, and a shared-memory array still alive at exit
    prints tracebacks from its finaliser)."""
    ends = np.cumsum(chunk.pop(LENGTHS))[:-1]
    parts = {k: np.split(np.array(v), ends) for k, v in chunk.items()}
    return [dict(zip(parts, values)) for values in zip(*parts.values())]


class _ExampleStreamIterator(grain.DatasetIterator):
    def __init__(self, stream: ExampleStream):
        super().__init__()
        self._stream, self._next, self._iterator = stream, 0, None
        self._chunk: list[dict] = []  # examples of the current chunk (workers), not yet taken

    def __next__(self) -> dict:
        if self._iterator is None:
            self._iterator = self._stream.open(self._next)  # workers start here
            if self._stream.num_workers > 0:
                _WITH_WORKERS.add(self)
        if not self._stream.num_workers:
            example = next(self._iterator)
        else:
            if not self._chunk:
                self._chunk = _split(next(self._iterator))[::-1]
            example = self._chunk.pop()
        self._next += 1
        return example

    def get_state(self) -> dict:
        return {"next_index": self._next}

    def set_state(self, state: dict) -> None:
        if state["next_index"] != self._next:
            self._close_iterator()
            self._next = state["next_index"]

    def _close_iterator(self) -> None:
        self._chunk = []
        if self._iterator is not None:
            self._iterator.close()  # stops its worker processes
            self._iterator = None

    def close(self) -> None:
        self._close_iterator()
        super().close()
