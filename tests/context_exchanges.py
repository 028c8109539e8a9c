"""The context layout's exchanges (model/parallel/context.py) on 8 host devices against numpy
loops: the balanced reordering and back, the rows before each chunk, the all-gather into
natural order and the document offsets. Imported by tests/context_worker.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from model.parallel.context import AXIS, ContextLayout, from_layout, to_layout
from model.parallel.rules import use_mesh
from train.config import MeshConfig
from train.parallel.sharding import make_mesh

LENGTH = 32


def natural_chunk(shards: int, slots: int, position: int, chunk: int) -> int:
    """Natural chunk of row `position` of the layout order: shard r's slots in turn, slot 0
    chunk r, slot 1 (balanced) chunk 2C-1-r."""
    shard, slot = divmod(position // chunk, slots)
    return shard if slot == 0 else 2 * shards - 1 - shard


def layout_rows(shards: int, slots: int) -> np.ndarray:
    """Natural index of each row in layout order."""
    chunk = LENGTH // (shards * slots)
    return np.array([natural_chunk(shards, slots, p, chunk) * chunk + p % chunk
                     for p in range(LENGTH)])


def document_offsets_loop(segments: np.ndarray) -> np.ndarray:
    out = np.zeros_like(segments)
    for b in range(segments.shape[0]):
        for t in range(1, segments.shape[1]):
            out[b, t] = out[b, t - 1] + 1 if segments[b, t] == segments[b, t - 1] else 0
    return out


def check_exchanges() -> dict:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, LENGTH, 3)).astype(np.float32)
    segments = np.sort(rng.integers(1, 5, size=(2, LENGTH)), axis=1).astype(np.int32)
    errors = {}
    for shards, data in ((8, 1), (4, 2)):
        mesh = make_mesh(MeshConfig(context=shards, data=data))
        for slots in (1, 2):
            layout = ContextLayout(shards, slots)
            rows = layout_rows(shards, slots)
            name = f"context={shards},slots={slots}"
            spec = P("data" if data > 1 else None, AXIS)

            def local(fn, *args, out_ndim=3):
                out_spec = P(*spec, *([None] * (out_ndim - 2)))
                return jax.jit(jax.shard_map(fn, in_specs=spec, out_specs=out_spec,
                                             check_vma=False))(*args)

            with use_mesh(mesh):
                ordered = jax.jit(functools.partial(to_layout, layout=layout))(x)
                back = jax.jit(functools.partial(from_layout, layout=layout))(ordered)
                gathered = local(lambda a: layout.gather(a)[:, None], ordered, out_ndim=4)
                halo = local(lambda a: layout.previous_rows(a, 11, fill=-7.0), ordered,
                             out_ndim=4)
                offsets = local(layout.document_offsets, segments[:, rows], out_ndim=2)
            halo_rows = np.asarray(halo).reshape(2, shards, slots, 11, 3)
            want_halo = np.zeros_like(halo_rows)
            chunk = LENGTH // (shards * slots)
            for r in range(shards):
                for j in range(slots):
                    first = rows[(r * slots + j) * chunk]
                    for i in range(11):
                        source = first - 11 + i
                        want_halo[:, r, j, i] = x[:, source] if source >= 0 else -7.0
            errors[name] = {
                "to_layout": float(np.abs(np.asarray(ordered) - x[:, rows]).max()),
                "from_layout": float(np.abs(np.asarray(back) - x).max()),
                "gather": float(np.abs(np.asarray(gathered) - x[:, None]).max()),
                "previous_rows": float(np.abs(halo_rows - want_halo).max()),
                "document_offsets": int(np.abs(np.asarray(offsets)
                                               - document_offsets_loop(segments)[:, rows]).max()),
            }
    return errors
