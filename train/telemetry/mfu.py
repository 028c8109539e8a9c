"""Model FLOPs utilisation: model FLOPs per trained token (from `model.flops`) against a measured
matmul peak of the same machine."""

import dataclasses
import time

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.flops import forward_flops


def train_flops_per_token(cfg: ModelConfig, seq_len: int, mtp_heads: int) -> float:
    """Forward + backward (3x forward) model FLOPs per token at context `seq_len`, counting the
    MTP heads that train."""
    cfg = cfg.replace(mtp=dataclasses.replace(cfg.mtp, num_heads=mtp_heads))
    return 3.0 * forward_flops(cfg, seq_len, "prefill")["total"] / seq_len


def measure_matmul_peak(size: int = 1024, repeats: int = 10) -> float:
    """Best observed float32 matmul FLOP/s of one device (a [size, size] @ [size, size] product)."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best
