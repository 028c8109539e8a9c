"""Device meshes from the command line (`--mesh tensor=2,expert=4`): parsing, and the mesh over
this process's devices that `python -m model.generate` / `model.chat` decode under.

    sizes = parse_mesh("tensor=2,expert=4")   # {"tensor": 2, "expert": 4}; -1 = the rest
    mesh = mesh_over({**sizes, ...}, jax.devices()[:8])
    mesh = decode_mesh("tensor=2,expert=4")   # None for None; refuses `pipeline`
    with use_decode_mesh(mesh):               # trace the decoder here
        ...

Axis names and what shards over them: model/parallel/rules.py. Decoding one conversation has
one row, which no data-parallel axis can split, so its rules (DECODE_RULES) keep the batch
whole on every device: parameters shard as in training (heads and FFN hidden over `tensor`,
routed experts over `expert`, `embed` over `fsdp`), activations are replicated, and each
device runs its own experts on every token (model/parallel/expert_parallel.py).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from model.parallel.rules import LOGICAL_RULES, MESH_AXES

DECODE_RULES = tuple((name, None) if name == "batch" else (name, axes)
                     for name, axes in LOGICAL_RULES)


def parse_mesh(text: str, flag: str = "--mesh") -> dict[str, int]:
    """'data=8,expert=8,pipeline=8' -> {'data': 8, 'expert': 8, 'pipeline': 8}; a size of -1
    takes the devices the others leave. Bad input: a one-line ValueError naming `flag`."""
    sizes: dict[str, int] = {}
    for item in text.split(","):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not name:
            raise ValueError(f"{flag}: expected comma-separated axis=size, e.g. "
                             f"data=8,expert=8,pipeline=8; got {text!r}")
        if name not in MESH_AXES:
            raise ValueError(f"{flag}: unknown axis {name!r}; axes are {', '.join(MESH_AXES)}")
        if name in sizes:
            raise ValueError(f"{flag}: axis {name!r} given twice")
        try:
            size = int(value)
        except ValueError:
            raise ValueError(f"{flag}: {name}={value!r} is not an integer") from None
        if size < 1 and size != -1:
            raise ValueError(f"{flag}: {name}={size} must be a positive integer or -1")
        sizes[name] = size
    if list(sizes.values()).count(-1) > 1:
        raise ValueError(f"{flag}: at most one axis may be -1 (it takes the remaining devices)")
    return sizes


def mesh_over(sizes: dict[str, int], devices: list) -> Mesh:
    """The mesh of `sizes` ({axis: size} over MESH_AXES, missing axes 1, their product the
    number of `devices`) with every axis Auto (GSPMD propagates shardings; shard_map regions
    take the axes they need)."""
    shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
    types = (AxisType.Auto,) * len(MESH_AXES)
    if len(devices) == len(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=types)


def decode_mesh(text: str | None, flag: str = "--mesh") -> Mesh | None:
    """The mesh a model decodes on: `text` parsed (None: no mesh, one device) over the first
    devices it needs. Decoding does not pipeline or split its sequence, so `pipeline` and
    `context` are refused; a mesh larger than the devices is named with the count."""
    if text is None:
        return None
    sizes = parse_mesh(text, flag)
    if sizes.get("pipeline", 1) != 1:
        raise ValueError(f"{flag}: decoding does not pipeline; shard the model over tensor, "
                         "expert and fsdp instead")
    if sizes.get("context", 1) != 1:
        raise ValueError(f"{flag}: decoding keeps each sequence whole, not split over context; "
                         "shard the model over tensor, expert and fsdp instead")
    devices = jax.devices()
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if -1 in sizes.values():
        if len(devices) % fixed:
            raise ValueError(f"{flag}: the fixed axes use {fixed} devices, which does not "
                             f"divide the {len(devices)} available")
        sizes = {a: len(devices) // fixed if s == -1 else s for a, s in sizes.items()}
    count = math.prod(sizes.values())
    if count > len(devices):
        raise ValueError(f"{flag}: {text} needs {count} devices, this process has "
                         f"{len(devices)} ({devices[0].platform})")
    return mesh_over(sizes, devices[:count])


@contextlib.contextmanager
def use_decode_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """The mesh and DECODE_RULES, as the model reads them while tracing a decoder."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(DECODE_RULES):
        yield mesh
