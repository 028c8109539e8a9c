"""Kernel timings of `make gpu-check` (benchmarks.gpu.suite): attention forward + backward per
`attention_impl` at long contexts, SWA and full, and the MoE layer (`moe_impl`) against a dense
SwiGLU of equal active FLOPs (benchmarks.moe_dispatch); `moe_impl=pallas` runs the Triton grouped
matmuls on GPU with `moe.block_size` rows per tile (rounded up to a power of two).

Attention TFLOP/s counts visible (query, key) pairs only, 4·D FLOPs per pair and head forward,
the backward 2.5x the forward (FlashAttention-2 paper's accounting, recomputation not counted),
as benchmarks.pallas_attention does; "% of peak" is against the device's dense bf16 peak.
Cases run in order until the section's deadline; a case that fails (e.g. out of memory: `xla`
builds [T, T] scores for full layers) is recorded with its error and the next one runs.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from benchmarks.common import time_compiled
from benchmarks.gpu.checks import first_line
from benchmarks.moe_dispatch import time_moe_layer
from model.flops import visible_pairs
from model.ops.tables import ATTENTION


class AttentionShape(NamedTuple):
    """One layer type's attention: query heads, KV heads, head dim; window None = full."""

    kind: str  # "swa" | "full"
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None


def _triton_attention():
    from pallas_kernels.attention import triton_attention
    return triton_attention


# Timed beside the implementation tables' cores: `pallas` runs the Mosaic GPU kernels on sm90,
# `pallas_triton` the Triton kernel there, for comparison.
EXTRA_CORES = {"pallas_triton": _triton_attention}


def kernel_family_note(impl: str, backend: str, shape: "AttentionShape", dtype) -> str:
    """Which flash-attention family `pallas` runs for this shape on this device."""
    if impl != "pallas" or backend != "gpu":
        return ""
    from pallas_kernels.attention import kernel_family
    from pallas_kernels.gpu_arch import compute_capability

    q = jax.ShapeDtypeStruct((1, 128, shape.heads, shape.head_dim), dtype)
    k = jax.ShapeDtypeStruct((1, 128, shape.kv_heads, shape.head_dim), dtype)
    return {"mosaic": "Mosaic GPU", "triton": "Triton"}[kernel_family(q, k, k,
                                                                      compute_capability())]


def timing_skip_reason(impl: str, backend: str) -> str | None:
    """Why a timing of `impl` on `backend` would not be a performance figure, or None."""
    if backend == "cpu" and impl.startswith("pallas"):
        return "Pallas runs in interpret mode on CPU: its time is not a performance figure"
    if backend == "cpu" and impl == "cudnn":
        return "no cuDNN on CPU (jax.nn.dot_product_attention falls back to XLA)"
    if backend == "tpu" and impl in ("pallas", "pallas_triton", "cudnn"):
        return f"attention_impl={impl} does not run on TPU"
    return None


def attention_seconds(impl: str, shape: AttentionShape, length: int, batch: int, dtype,
                      repeats: int, core=None) -> float:
    """Median seconds of jitted forward + backward (all of dq, dk, dv) of one attention core
    (`core`, default: the one `impl` names)."""
    if core is None:
        core = ATTENTION.resolve(impl) if impl in ATTENTION.names else EXTRA_CORES[impl]()
    keys = jax.random.split(jax.random.key(length), 4)
    q = jax.random.normal(keys[0], (batch, length, shape.heads, shape.head_dim), dtype)
    k, v = (jax.random.normal(key, (batch, length, shape.kv_heads, shape.head_dim), dtype)
            for key in keys[1:3])
    cotangent = jax.random.normal(keys[3], q.shape, dtype)

    def forward_backward(q, k, v, cotangent):
        out, vjp = jax.vjp(lambda q, k, v: core(q, k, v, window=shape.window, segment_ids=None,
                                                sink=None), q, k, v)
        return vjp(cotangent)

    compiled = jax.jit(forward_backward).lower(q, k, v, cotangent).compile()
    return time_compiled(compiled, q, k, v, cotangent, repeats=repeats)


def time_attention(shapes: list[AttentionShape], lengths: list[int], impls: list[str], *,
                   batch: int, dtype, repeats: int, backend: str, peak_tflops: float | None,
                   deadline: float) -> list[dict]:
    records = []
    for length in lengths:
        for shape in shapes:
            for impl in impls:
                record = {"length": length, "kind": shape.kind, "impl": impl,
                          "shape": f"B={batch} H={shape.heads} K={shape.kv_heads} "
                                   f"D={shape.head_dim} W={shape.window or 'full'}"}
                reason = timing_skip_reason(impl, backend)
                if reason is None and time.monotonic() > deadline:
                    reason = "section time limit reached"
                if reason:
                    records.append({**record, "status": "skipped", "note": reason})
                    continue
                try:
                    seconds = attention_seconds(impl, shape, length, batch, dtype, repeats)
                except Exception as err:  # e.g. out of memory; the next case still runs
                    records.append({**record, "status": "error", "note": first_line(err)})
                    continue
                flops = 3.5 * 4 * visible_pairs(length, shape.window) * shape.head_dim \
                    * shape.heads * batch
                tflops = flops / seconds / 1e12
                records.append({**record, "status": "done", "fwd_bwd_ms": seconds * 1e3,
                                "tflops": tflops, "of_peak": tflops / peak_tflops
                                if peak_tflops else None,
                                "note": kernel_family_note(impl, backend, shape, dtype)})
    return records


def time_moe(*, tokens: int, d_model: int, experts: int, top_k: int, expert_hidden: int,
             block_size: int, impls: list[str], dtype, rounds: int, backend: str) -> list[dict]:
    """benchmarks.moe_dispatch's interleaved timing (one record per impl plus "dense FFN");
    `pallas` (Triton kernels on GPU, Mosaic on TPU) is recorded as skipped on CPU, where it
    runs in interpret mode."""
    skipped = {impl: "Pallas runs in interpret mode on CPU: its time is not a performance figure"
               for impl in impls if impl == "pallas" and backend == "cpu"}
    timed = time_moe_layer(tokens=tokens, d_model=d_model, experts=experts, top_k=top_k,
                           expert_hidden=expert_hidden, block_size=block_size, rounds=rounds,
                           impls=[impl for impl in impls if impl not in skipped],
                           dtype=jnp.dtype(dtype))
    return ([{**r, "status": "done", "fwd_bwd_ms": r["seconds"] * 1e3} for r in timed]
            + [{"impl": impl, "status": "skipped", "note": note} for impl, note in skipped.items()])
