"""Correctness checks of `make gpu-check` (benchmarks.gpu.suite): every attention and MoE
implementation of the implementation tables against a plain XLA reference, forward and
gradients, and the expert-parallel `ragged` collective against one device.

The references are written here, independently of `model.ops`, in float32 with matmuls at
HIGHEST precision (docs/architecture.md, "Exact semantics"):
- attention: softmax(q kᵀ / √D) v over an explicit [T, T] mask (query i sees key j iff j <= i,
  i - j < W and both are in the same segment), KV heads repeated for GQA, the sink as one more
  logit whose value is zero;
- MoE: every expert's SwiGLU (with the report's clamp, 4.1.3) on every token; copy (n, j) takes
  the row of expert indices[n, j].
Each implementation runs on the inputs cast to its case's dtype; the reference sees the same
(rounded) values in float32. The error of an output or gradient is max|got - want| / max|want|,
one scale-free number per array, held against TOLERANCE of the case's dtype.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu.attention_checks import attention_verdict
from model.ops.moe_dispatch import ExpertWeights
from model.ops.pallas_moe import expert_plan
from model.ops.swiglu import SwiGLUClamp
from model.ops.tables import ATTENTION, MOE

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
# float32 allows for TF32 matmuls (XLA's default on NVIDIA GPUs, ~1e-3 relative); bfloat16 for
# 8-bit mantissas of the inputs and of the kernels' bf16 probabilities / intermediates.
TOLERANCE = {"float32": 5e-3, "bfloat16": 5e-2}


class AttentionCase(NamedTuple):
    label: str
    batch: int
    length: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None  # None: full causal
    segments: bool  # two packed documents per row
    sink: bool  # a per-head sink logit
    dtype: str
    v_head_dim: int | None = None  # None: head_dim (MiMo-V2-Flash: 192 / 128)


class MoECase(NamedTuple):
    label: str
    tokens: int
    d_model: int
    experts: int
    top_k: int
    hidden: int
    limit: float  # SwiGLU clamp L (0: none)
    dtype: str


# ---- references -------------------------------------------------------------------------------


def reference_attention(q, k, v, *, window, segment_ids, sink):
    """q [B, T, H, D], k/v [B, T, K, D] -> [B, T, H, D] float32."""
    q, k, v = (x.astype(F32) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    scores = jnp.einsum("bthd,bshd->bhts", q, k, precision=HIGHEST) / np.sqrt(q.shape[-1])
    i, j = np.arange(q.shape[1])[:, None], np.arange(q.shape[1])[None, :]
    mask = (j <= i) & ((i - j < window) if window is not None else True)
    mask = jnp.asarray(mask)[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    scores = jnp.where(mask, scores, -1e30)
    if sink is not None:  # one extra logit per (row, head) whose value vector is zero
        column = jnp.broadcast_to(sink.astype(F32)[None, :, None, None], scores.shape[:3] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, v, precision=HIGHEST)


def reference_moe(x, indices, weights: ExpertWeights, clamp: SwiGLUClamp, block_size):
    """The `moe_impl` signature: x [N, D], indices [N, k] -> (per-copy outputs [N, k, D], {})."""
    del block_size
    x = x.astype(F32)
    gate_w, up_w, down_w = (w.astype(F32) for w in weights)
    gate = jnp.einsum("nd,edf->enf", x, gate_w, precision=HIGHEST)
    up = jnp.einsum("nd,edf->enf", x, up_w, precision=HIGHEST)
    silu = jax.nn.silu(gate)
    if clamp.limit > 0:  # Step 3.5's clamp (report 4.1.3): after the SiLU
        silu, up = jnp.minimum(silu, clamp.limit), jnp.clip(up, -clamp.limit, clamp.limit)
    every = jnp.einsum("enf,efd->end", silu * up, down_w, precision=HIGHEST)  # [E, N, D]
    return every[indices, jnp.arange(x.shape[0])[:, None]], {}


# ---- inputs -----------------------------------------------------------------------------------


def attention_inputs(case: AttentionCase, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    b, t, h, kv, d = case.batch, case.length, case.heads, case.kv_heads, case.head_dim
    dv = case.v_head_dim or d
    dtype = jnp.dtype(case.dtype)
    arrays = {name: jnp.asarray(rng.normal(size=shape), F32).astype(dtype) for name, shape in
              (("q", (b, t, h, d)), ("k", (b, t, kv, d)), ("v", (b, t, kv, dv)))}
    arrays["cotangent"] = jnp.asarray(rng.normal(size=(b, t, h, dv)), F32)
    # Row r: a second document starts at token t // (3 + r).
    starts = t // (3 + np.arange(b))[:, None]
    arrays["segment_ids"] = (jnp.asarray(1 + (np.arange(t)[None, :] >= starts), jnp.int32)
                             if case.segments else None)
    arrays["sink"] = (jnp.asarray(rng.uniform(-2.0, 2.5, size=h), F32) if case.sink else None)
    return arrays


def moe_inputs(case: MoECase, seed: int = 0) -> dict:
    """Routing skewed on purpose: the first quarter of the tokens all pick experts 0..k-1, so
    group sizes differ widely and some experts may get no row."""
    rng = np.random.default_rng(seed)
    n, d, e, k, f = case.tokens, case.d_model, case.experts, case.top_k, case.hidden
    dtype = jnp.dtype(case.dtype)
    indices = np.argsort(rng.uniform(size=(n, e)), axis=1)[:, :k]
    indices[: n // 4] = np.arange(k)
    weights = ExpertWeights(*(jnp.asarray(rng.normal(size=s) * scale, F32).astype(dtype)
                              for s, scale in (((e, d, f), d ** -0.5), ((e, d, f), d ** -0.5),
                                               ((e, f, d), f ** -0.5))))
    return {"x": jnp.asarray(rng.normal(size=(n, d)), F32).astype(dtype),
            "indices": jnp.asarray(indices, jnp.int32), "weights": weights,
            "cotangent": jnp.asarray(rng.normal(size=(n, k, d)), F32)}


# ---- comparison -------------------------------------------------------------------------------


def relative_errors(got: dict, want: dict) -> dict[str, float]:
    """{name: max|got - want| / max|want|} over the arrays both dicts name."""
    errors = {}
    for name, expected in want.items():
        expected = np.asarray(expected, np.float64)
        actual = np.asarray(jnp.asarray(got[name]).astype(F32), np.float64)
        scale = max(float(np.max(np.abs(expected))), 1e-30)
        errors[name] = float(np.max(np.abs(actual - expected))) / scale
    return errors


def verdict(errors: dict[str, float], tolerance: float) -> str:
    finite = all(np.isfinite(e) for e in errors.values())
    return "pass" if finite and max(errors.values()) <= tolerance else "fail"


def attention_outputs(core: Callable, case: AttentionCase, inputs: dict) -> tuple[dict, str]:
    """({"out", "dq", "dk", "dv"[, "dsink"]}, compiled HLO text) of `core` on `inputs`, the
    gradients those of sum(out * cotangent)."""
    segment_ids, sink, cotangent = inputs["segment_ids"], inputs["sink"], inputs["cotangent"]

    def loss(q, k, v, sink):
        out = core(q, k, v, window=case.window, segment_ids=segment_ids, sink=sink)
        return jnp.sum(out.astype(F32) * cotangent), out

    argnums = (0, 1, 2, 3) if sink is not None else (0, 1, 2)
    grad = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))
    compiled = grad.lower(inputs["q"], inputs["k"], inputs["v"], sink).compile()
    grads, out = compiled(inputs["q"], inputs["k"], inputs["v"], sink)
    names = ("dq", "dk", "dv", "dsink")[:len(grads)]
    return {"out": out, **dict(zip(names, grads))}, compiled.as_text() or ""


def moe_outputs(impl: Callable, case: MoECase, inputs: dict) -> dict:
    """{"out", "dx", "dgate", "dup", "ddown"} of `impl`, the gradients of sum(out * cotangent)."""
    clamp, cotangent = SwiGLUClamp(case.limit), inputs["cotangent"]

    def loss(x, weights):
        out, _ = impl(x, inputs["indices"], ExpertWeights(*weights), clamp, 64)
        return jnp.sum(out.astype(F32) * cotangent), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(
        inputs["x"], tuple(inputs["weights"]))
    dx, (dgate, dup, ddown) = grads
    return {"out": out, "dx": dx, "dgate": dgate, "dup": dup, "ddown": ddown}


# ---- checks -----------------------------------------------------------------------------------


def unsupported(table: str, impl: str, backend: str) -> str | None:
    """Why `impl` cannot run on `backend` at all (known beforehand), or None."""
    if table == "attention" and impl == "pallas" and backend == "tpu":
        return "the flash-attention kernel is Triton (GPU) only; attention_impl=xla serves TPUs"
    return None


def kernel_note(impl: str, backend: str, hlo: str) -> str:
    """What actually ran behind `impl` here, from the compiled HLO where it can tell."""
    if backend == "cpu" and impl == "pallas":
        return "Pallas interpret mode"
    if backend == "gpu" and impl == "pallas":
        return "Pallas Triton kernels"
    return ""


def _record(table: str, impl: str, label: str, shape: str, dtype: str, **fields) -> dict:
    return {"table": table, "impl": impl, "case": label, "shape": shape, "dtype": dtype, **fields}


def check_attention(case: AttentionCase, backend: str) -> list[dict]:
    inputs = attention_inputs(case)
    want, _ = attention_outputs(reference_attention, case, inputs)
    dims = f"{case.head_dim}/{case.v_head_dim}" if case.v_head_dim else case.head_dim
    shape = (f"B={case.batch} T={case.length} H={case.heads} K={case.kv_heads} "
             f"D={dims} W={case.window or 'full'}"
             + (" segments" if case.segments else "") + (" sink" if case.sink else ""))
    records = []
    for impl in ATTENTION.names:
        fields = dict(tolerance=TOLERANCE[case.dtype])
        reason = unsupported("attention", impl, backend)
        if reason:
            records.append(_record("attention", impl, case.label, shape, case.dtype,
                                   status="skipped", note=reason, **fields))
            continue
        try:
            got, hlo = attention_outputs(ATTENTION.resolve(impl), case, inputs)
            errors = relative_errors(got, want)
            note, problem = attention_verdict(impl, backend, inputs, case.window, hlo)
            records.append(_record("attention", impl, case.label, shape, case.dtype,
                                   status="fail" if problem else verdict(errors,
                                                                         fields["tolerance"]),
                                   errors=errors,
                                   compared=int(sum(np.size(w) for w in want.values())),
                                   note=f"{note}: {problem}" if problem else note, **fields))
        except Exception as err:  # one broken kernel must not hide the others' results
            records.append(_record("attention", impl, case.label, shape, case.dtype,
                                   status="error", note=first_line(err), **fields))
    return records


def check_moe(case: MoECase, backend: str) -> list[dict]:
    inputs = moe_inputs(case)
    want = moe_outputs(reference_moe, case, inputs)
    shape = (f"N={case.tokens} D={case.d_model} E={case.experts} k={case.top_k} "
             f"F={case.hidden} L={case.limit:g}")
    records = []
    for impl in MOE.names:
        fields = dict(tolerance=TOLERANCE[case.dtype])
        reason = unsupported("moe", impl, backend)
        if reason:
            records.append(_record("moe", impl, case.label, shape, case.dtype,
                                   status="skipped", note=reason, **fields))
            continue
        try:
            errors = relative_errors(moe_outputs(MOE.resolve(impl), case, inputs), want)
            records.append(_record("moe", impl, case.label, shape, case.dtype,
                                   status=verdict(errors, fields["tolerance"]), errors=errors,
                                   compared=int(sum(np.size(w) for w in want.values())),
                                   note=moe_kernels(case, backend) if impl == "pallas"
                                   else kernel_note(impl, backend, ""), **fields))
        except Exception as err:
            records.append(_record("moe", impl, case.label, shape, case.dtype,
                                   status="error", note=first_line(err), **fields))
    return records


def moe_kernels(case: MoECase, backend: str) -> str:
    """The grouped-matmul kernels of `moe_impl=pallas` for this case, per leg (both expert
    matmuls' when they differ), as the choice table picks them here."""
    if backend == "cpu":
        return "Pallas interpret mode"
    plan = expert_plan(None, case.d_model, case.hidden, jnp.dtype(case.dtype), 8,
                       interpret=False)
    return "; ".join(f"{leg} " + "/".join(dict.fromkeys(
        getattr(legs, leg).backend for legs in plan)) for leg in ("fwd", "dx", "dw"))


def first_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text}"[:limit]
