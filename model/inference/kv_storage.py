"""How a decode cache stores its key/value rows (`KVCacheSpec.fp8`): as computed, or in
DeepSeek-V4's mixed layout (report §2.3.4: "RoPE dimensions in BF16, the rest in FP8"; the
release quantizes those with its `act_quant`, E4M3 in blocks of 64 with power-of-two scales):

    Fp8Rows(values  [..., C - R] float8_e4m3fn   the channels outside the RoPE range
            exponents [..., ceil((C - R) / 64)] int8, scale 2^e per block of 64 of them
            kept    [..., R] compute dtype       the RoPE channels, as computed)

about (C - R) · 1.02 + 2R bytes a row instead of 2C in bfloat16. Every row the attention reads,
the chunk's own included, has been through the format, so a token sees the same keys whether
they come from the cache or from its own chunk.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from model.ops.mx_quant import fp8_blocks, mx_dequantize

FP8_BLOCK = 64


class Fp8Rows(NamedTuple):
    values: jax.Array
    exponents: jax.Array
    kept: jax.Array


@dataclasses.dataclass(frozen=True)
class RowFormat:
    """`fp8`: store rows as Fp8Rows, channels [kept[0], kept[1]) (the RoPE ones) unquantized;
    else as computed. (Static: not a pytree.)"""

    fp8: bool = False
    kept: tuple[int, int] = (0, 0)

    def encode(self, x: jax.Array):
        """Rows [..., C] -> their stored form."""
        if not self.fp8:
            return x
        lo, hi = self.kept
        values, exponents = fp8_blocks(jnp.concatenate([x[..., :lo], x[..., hi:]], -1),
                                       FP8_BLOCK)
        return Fp8Rows(values, exponents.astype(jnp.int8), x[..., lo:hi])

    def decode(self, rows, dtype) -> jax.Array:
        """The stored form -> rows [..., C] in `dtype`."""
        if not self.fp8:
            return rows.astype(dtype)
        lo, _ = self.kept
        rest = mx_dequantize(rows.values, rows.exponents.astype(jnp.int32), FP8_BLOCK)
        return jnp.concatenate([rest[..., :lo], rows.kept.astype(jnp.float32), rest[..., lo:]],
                               -1).astype(dtype)

    def empty(self, shape: tuple[int, ...], dtype):
        return self.encode(jnp.zeros(shape, dtype))
