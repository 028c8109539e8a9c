"""The implementation tables: one per switch, used both to validate the config and to dispatch.

    ATTENTION.check("pallas")         # ValueError naming `attention_impl` and the allowed values
    core = ATTENTION.resolve("xla")   # the function, imported on first use

Each entry names its function as "module:function" and is imported only when a model asks for
it, so a CPU run never imports the Pallas kernels (nor their Triton/Mosaic lowering). An entry
may instead map backends ("tpu", "gpu", "cpu"; "default" for the rest) to functions: the one
for the backend being traced for (`pallas_kernels.target`) is taken. Every
implementation of a switch has the same signature and semantics (docs/architecture.md,
"Implementation tables"); the tests prove they agree.
"""

from __future__ import annotations

import importlib
from typing import Callable

from model.config.core import check_choice
from pallas_kernels.target import target_backend


class ImplementationTable:
    """Switch values -> "module:function" entries (or {backend: entry}), resolved lazily."""

    def __init__(self, switch: str, entries: dict[str, str | dict[str, str]]):
        self.switch = switch
        self.entries = dict(entries)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def check(self, value) -> None:
        check_choice(self.switch, value, self.names)

    def resolve(self, value: str) -> Callable:
        self.check(value)
        entry = self.entries[value]
        if isinstance(entry, dict):
            entry = entry.get(target_backend(), entry["default"])
        module, _, function = entry.partition(":")
        return getattr(importlib.import_module(module), function)


# attention_impl: (q [B,T,H,D], k/v [B,T,K,D], *, window, segment_ids, sink) -> [B,T,H,D]
# (`model.ops.attention_cores.AttentionCore`).
ATTENTION = ImplementationTable("attention_impl", {
    "xla": "model.ops.attention_cores:xla_attention",
    "cudnn": "model.ops.cudnn_attention:cudnn_attention",
    "pallas": {"tpu": "pallas_kernels.splash_attention:splash_attention_core",
               "default": "pallas_kernels.attention:flash_attention_core"},
})

# moe_impl: (x [N,D], indices [N,k], ExpertWeights, SwiGLUClamp, block_size)
#   -> (per-copy outputs [N,k,D], per-expert statistic sums) (`model.ops.moe_dispatch.GroupedFFN`).
MOE = ImplementationTable("moe_impl", {
    "sorted": "model.ops.moe_dispatch:sorted_block_ffn",
    "ragged_dot": "model.ops.moe_dispatch:ragged_dot_ffn",
    "pallas": "model.ops.pallas_moe:pallas_moe_ffn",
})
