"""The expert-parallel `ragged` collective of `make gpu-check` (benchmarks.gpu.suite): the routed
experts spread over every device on the mesh axis `expert` (report 3.2), tokens exchanged with
`lax.ragged_all_to_all`, against the same experts on one device: outputs and gradients.

Routing is skewed (3/4 of the tokens pick experts 0 and 1, on device 0) so that chunk sizes
differ across devices and one device receives most copies; nothing may be dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu.checks import TOLERANCE, first_line, relative_errors, verdict
from model.layers.moe import routed_experts
from model.ops.moe_dispatch import ExpertWeights
from model.ops.swiglu import SwiGLUClamp
from model.parallel.expert_parallel import expert_parallel_experts
from model.parallel.rules import use_mesh
from train.config import MeshConfig
from train.parallel.sharding import make_mesh


def skip_reason(backend: str, devices: int) -> str | None:
    if devices < 2:
        return "one device: the ragged all-to-all needs several"
    if backend == "cpu":
        return "XLA:CPU has no ragged all-to-all (tests/train/test_parallel.py checks `padded`)"
    return None


def check_ragged_collective(backend: str) -> list[dict]:
    peers = jax.device_count()
    record = {"table": "expert_parallel", "impl": "ragged", "case": "skewed routing",
              "dtype": "float32", "tolerance": TOLERANCE["float32"]}
    reason = skip_reason(backend, peers)
    if reason:
        return [{**record, "shape": f"{peers} device(s)", "status": "skipped", "note": reason}]
    tokens, d_model, hidden, experts, top_k = 64 * peers, 64, 128, 4 * peers, 2
    record["shape"] = (f"expert={peers} N={tokens} D={d_model} E={experts} k={top_k} "
                       f"F={hidden}")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(tokens, d_model)), jnp.float32)
    indices = np.argsort(rng.uniform(size=(tokens, experts)), axis=1)[:, :top_k]
    indices[: tokens * 3 // 4] = (0, 1)
    indices = jnp.asarray(indices, jnp.int32)
    combine = jnp.asarray(rng.uniform(size=(tokens, top_k)), jnp.float32)
    weights = ExpertWeights(*(jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32) for s in (
        (experts, d_model, hidden), (experts, d_model, hidden), (experts, hidden, d_model))))
    options = dict(clamp=SwiGLUClamp(0.0), impl="ragged_dot", block_size=64)

    def single(x, w):
        return routed_experts(x, indices, combine, ExpertWeights(*w), **options)[0]

    def parallel(x, w):
        return expert_parallel_experts(x, indices, combine, ExpertWeights(*w),
                                       collective="ragged", **options)[0]

    def outputs(fn):
        loss = lambda x, w: jnp.sum(jnp.sin(fn(x, w)))  # noqa: E731
        grad_x, grad_w = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, tuple(weights))
        return {"out": jax.jit(fn)(x, tuple(weights)), "dx": grad_x, "dgate": grad_w[0],
                "dup": grad_w[1], "ddown": grad_w[2]}

    try:
        want = outputs(single)
        with use_mesh(make_mesh(MeshConfig(expert=peers))):
            got = outputs(parallel)
            hlo = jax.jit(parallel).lower(x, tuple(weights)).compile().as_text() or ""
        errors = relative_errors(got, want)
        note = ("ragged-all-to-all in the compiled HLO" if "ragged-all-to-all" in hlo
                else "no ragged-all-to-all in the compiled HLO")
        return [{**record, "status": verdict(errors, record["tolerance"]), "errors": errors,
                 "compared": int(sum(np.size(w) for w in want.values())), "note": note}]
    except Exception as err:  # reported, not raised: the other sections still run
        return [{**record, "status": "error", "note": first_line(err)}]
