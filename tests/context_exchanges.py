"""The context layout's exchanges (model/parallel/context.py) on 8 host devices against numpy
loops: the balanced reordering and back, the rows before each chunk, the all-gather into
natural order and the document offsets; and the GQA attention cores per shard
(model/parallel/context_attention.py: the Pallas flash kernel in interpret mode and the XLA
core, window and full) against the XLA core on one device. Imported by
tests/context_worker.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from model.ops.tables import ATTENTION
from model.parallel.context import AXIS, ContextLayout, from_layout, to_layout
from model.parallel.context_attention import context_attention
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


def check_attention_cores() -> dict:
    """Max abs error of each core per shard (context=4, data=2, balanced: chunks of 4 rows
    under a window of 8), output and gradients, against the XLA core on one device; three
    documents, a sink."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, LENGTH, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, LENGTH, 2, 8)), jnp.float32) for _ in range(2))
    segments = jnp.asarray(np.repeat([[1] * 11 + [2] * 13 + [3] * 8], 2, 0), jnp.int32)
    sink = jnp.asarray(rng.normal(size=(4,)), jnp.float32)
    layout = ContextLayout(4, 2)
    rows = layout_rows(4, 2)
    mesh = make_mesh(MeshConfig(context=4, data=2))
    errors = {}

    def with_grads(fn):  # the output and the gradients of a loss of it in q, k, v and the sink
        def loss(q, k, v, sink):
            out = fn(q, k, v, sink)
            return jnp.sum(jnp.sin(out)), out
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

    for window in (8, None):
        core = ATTENTION.resolve("xla")
        want_grads, want = with_grads(lambda q, k, v, sink: core(
            q, k, v, window=window, segment_ids=segments, sink=sink))(q, k, v, sink)
        for impl in ("xla", "pallas"):
            split = context_attention(ATTENTION.resolve(impl), layout)
            with use_mesh(mesh):
                got_grads, got = with_grads(lambda q, k, v, sink: split(
                    q, k, v, window=window, segment_ids=segments[:, rows], sink=sink))(
                    q[:, rows], k[:, rows], v[:, rows], sink)
            # layout order back to natural for q, k, v; the sink's gradient as it is
            back = np.argsort(rows)
            got_grads = [np.asarray(g)[:, back] for g in got_grads[:3]] + [got_grads[3]]
            errors[f"{impl},window={window}"] = max(
                float(np.abs(np.asarray(got)[:, back] - np.asarray(want)).max()),
                *(float(np.abs(np.asarray(g) - np.asarray(w)).max())
                  for g, w in zip(got_grads, want_grads)))
    return errors
