"""Which kernel runs each leg (fwd, dx, dw; `pallas_kernels.grouped_legs`) of the MoE's grouped
matmuls: measured rows first, then the rule.

A row of grouped_leg_table.json records the fastest correct choice that `make gpu-check`'s
per-leg sweep (benchmarks/gpu/moe_legs.py) measured for one device kind, JAX minor version,
dtype, leg and matmul width (k: lhs columns, contracted by fwd/dx and the rows of dw's [E, k, n]
output; n: output columns), with its TFLOP/s. The sweep writes DIR/grouped_leg_table.json (the
committed rows with its own in place of those of the same key): copy it here to adopt it; rows
it adds with `install` serve the rest of its run. `choose` takes the row of the same device, JAX
and dtype for the leg whose (k, n) is nearest (exact first), else the rule.

The rule (UNMEASURED: what runs until a row exists):
- NVIDIA Hopper (sm90, Mosaic GPU importable) with 16-bit operands: fwd and dx on the Mosaic
  GPU kernels (`grouped_matmul_mgpu.DEFAULT_BLOCKS`), dw on our Triton tgmm. Why not Mosaic for
  dw: upstream's own GPU test of its transposed ragged dot is skipped as broken in CI (jax
  tests/pallas/mgpu_ragged_dot_test.py), and tokamax's H100 tables put its Mosaic weight
  gradient at 110-150 TFLOP/s against ~500 for Triton.
- other NVIDIA GPUs, or float32 operands on any GPU (wgmma would round them to TF32): Triton.
- TPU, and CPU (interpret mode, tests): the Mosaic TPU kernels.
Triton and Mosaic TPU choices of the rule carry no config: the MoE fills in its row tile
(`model.ops.pallas_moe.moe_tiling`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import mosaic_gpu
from pallas_kernels.grouped_legs import LEGS, LegChoice
from pallas_kernels.target import target_backend

TABLE = Path(__file__).with_name("grouped_leg_table.json")


class Row(NamedTuple):
    device: str  # jax.Device.device_kind, e.g. "NVIDIA H100 80GB HBM3"
    jax: str  # major.minor, e.g. "0.11"
    dtype: str  # operand dtype, e.g. "bfloat16"
    leg: str  # fwd | dx | dw
    k: int
    n: int
    backend: str
    config: tuple | None
    tflops: float  # measured at the sweep's row count
    source: str  # the run the row comes from

    @property
    def key(self) -> tuple:
        return self.device, self.jax, self.dtype, self.leg, self.k, self.n

    @classmethod
    def from_json(cls, entry: dict) -> "Row":
        config = entry.get("config")
        return cls(**{**entry, "config": None if config is None else tuple(config)})


@functools.lru_cache(maxsize=None)
def load_rows(path: Path = TABLE) -> tuple[Row, ...]:
    return tuple(Row.from_json(entry) for entry in json.loads(Path(path).read_text())["rows"])


_INSTALLED: list[Row] = []  # rows a running sweep added, ahead of the file's
# (backend, leg) -> why it is not to be used in this process (set by a caller that found it
# failing on the device, e.g. `make gpu-check`'s probe)
UNAVAILABLE: dict[tuple[str, str], str] = {}


def install(rows) -> None:
    _INSTALLED[:0] = list(rows)


def measured() -> tuple[Row, ...]:
    return tuple(_INSTALLED) + load_rows()


def merged_table(rows, status: str) -> dict:
    """The committed table with `rows` in place of those of the same key (JSON-able)."""
    new = {row.key: row for row in rows}
    kept = [row for row in load_rows() if row.key not in new]
    return {"status": status, "rows": [row._asdict() for row in [*kept, *new.values()]]}


class Device(NamedTuple):
    platform: str  # the backend traced for (pallas_kernels.target): cpu | gpu | tpu
    kind: str
    hopper: bool  # sm90 with Mosaic GPU
    jax: str  # major.minor


def current_device() -> Device:
    return Device(target_backend(), jax.devices()[0].device_kind,
                  mosaic_gpu.hopper_available(), ".".join(jax.__version__.split(".")[:2]))


def rule(leg: str, dtype, device: Device) -> LegChoice:
    """The unmeasured default (module docstring)."""
    if device.platform != "gpu":
        return LegChoice("mosaic_tpu")
    if (device.hopper and jnp.dtype(dtype).itemsize == 2 and leg != "dw"
            and ("mosaic_gpu", leg) not in UNAVAILABLE):
        return LegChoice("mosaic_gpu")
    return LegChoice("triton")


def choose(leg: str, k: int, n: int, dtype, device: Device | None = None,
           rows: tuple[Row, ...] | None = None) -> LegChoice:
    """The choice for one matmul of `leg` with widths (k, n) and operands of `dtype`, from
    `rows` (None: `measured()`)."""
    if leg not in LEGS:
        raise ValueError(f"leg: expected one of {LEGS}, got {leg!r}")
    device = device or current_device()
    rows = measured() if rows is None else rows
    dtype = jnp.dtype(dtype).name
    candidates = [r for r in rows if (r.device, r.jax, r.dtype, r.leg)
                  == (device.kind, device.jax, dtype, leg) and (r.backend, leg) not in UNAVAILABLE]
    if not candidates:
        return rule(leg, dtype, device)
    best = min(candidates, key=lambda r: abs(r.k * r.n - k * n) + abs(r.k - k) + abs(r.n - n))
    return LegChoice(best.backend, None if best.config is None else tuple(best.config))
