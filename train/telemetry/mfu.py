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


def measure_matmul_peak(shape: tuple[int, int, int] = (2048, 2048, 2048),
                        repeats: int = 10) -> float:
    """Best observed float32 FLOP/s of one device on an [m, k] @ [k, n] product, shape (m, k, n).

    The default is large enough to reach the machine's matmul peak: on a 2-core Xeon a 1024^3
    product gave 162-181 GFLOP/s where 2048-row products ran at 250-360, which overstated MFU."""
    m, k, n = shape
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * m * k * n / best
