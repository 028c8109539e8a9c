"""Block sizes of the Mosaic GPU flash-attention kernels, read from flash_attention_blocks.json.

Entries are keyed "{Dk}x{Dv}" (query/key and value head dims) with a "default" for other dims;
each kernel (forward, dq, dkv) gets [block, stream, compute warpgroups, ring stages]
(`mgpu_attention_common.Blocks`). The committed table says in its "status" whether it was
measured: `python -m benchmarks.gpu.attention_sweep` times candidates on the device (one call
of `make gpu-check`, section `attention_sweep`) and writes the chosen table with the device
and date; copy it here to adopt it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from pallas_kernels.mgpu_attention_common import Blocks

TABLE = Path(__file__).with_name("flash_attention_blocks.json")
KERNELS = ("forward", "dq", "dkv")


@functools.lru_cache(maxsize=None)
def load_table(path: Path = TABLE) -> dict:
    table = json.loads(Path(path).read_text())
    for key, entry in table["entries"].items():
        for kernel in KERNELS:
            Blocks(*entry[kernel]).check(f"{path.name}: {key}.{kernel}")
    return table


def mosaic_blocks(head_dim: int, v_head_dim: int,
                  table: dict | None = None) -> tuple[Blocks, Blocks, Blocks]:
    """(forward, dq, dkv) blocks for these head dims."""
    entries = (table or load_table())["entries"]
    entry = entries.get(f"{head_dim}x{v_head_dim}", entries["default"])
    return tuple(Blocks(*entry[kernel]) for kernel in KERNELS)
