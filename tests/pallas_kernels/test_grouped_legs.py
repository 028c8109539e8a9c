"""`moe_impl=pallas` with a kernel family per leg (fwd, dx, dw) against float64 loops, and the
table that chooses the families.

The routed-expert references are the copy-by-copy float64 loops of tests/moe_references.py
(outputs and the gradients of x, the combine weights and the three expert weights). The routing
is skewed (one expert takes most copies), two experts get nothing, one copy goes to "no expert"
(the padding id E), and D = 40, F = 24 are off the kernels' 64-wide blocks.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_references import np_routed_experts, np_routed_experts_grads, rel_error

from model.ops import pallas_moe
from model.ops.moe_dispatch import ExpertWeights, combine_copies
from model.ops.swiglu import SwiGLUClamp
from pallas_kernels import grouped_leg_table as table
from pallas_kernels.grouped_legs import LegChoice, LegPlan
from pallas_kernels.grouped_matmul_mgpu import DEFAULT_BLOCKS

LIMIT = 0.5
# Mosaic GPU's fwd and dx (interpreted) beside another family's dw: the Hopper rule pairs them
# with Triton's tgmm, whose own tests are in test_pallas_moe_triton.py.
PLANS = {"Mosaic GPU fwd/dx, lax.ragged_dot dw": LegPlan(LegChoice("mosaic_gpu"),
                                                          LegChoice("mosaic_gpu"),
                                                          LegChoice("xla")),
         "lax.ragged_dot everywhere": LegPlan.uniform("xla")}


def skewed_case():
    rng = np.random.default_rng(7)
    n, e, k, d, f = 24, 6, 2, 40, 24
    first = np.where(rng.uniform(size=n) < 0.75, 3, rng.choice([0, 4, 5], size=n))
    second = np.where(first == 3, rng.choice([0, 5], size=n), 3)
    idx = np.stack([first, second], axis=1).astype(np.int32)  # experts 1 and 2 get nothing
    x = rng.normal(size=(n, d)).astype(np.float32)
    combine = rng.uniform(0.2, 1.5, size=(n, k)).astype(np.float32)
    weights = ExpertWeights(*(rng.normal(size=s).astype(np.float32) * 2 / np.sqrt(s[1])
                              for s in ((e, d, f), (e, d, f), (e, f, d))))
    probe = rng.normal(size=(n, d)).astype(np.float32)
    return x, idx, combine, weights, probe


@functools.lru_cache(maxsize=None)
def value_and_grads(plan):
    def loss(x, combine, weights, idx, probe):
        out, _ = pallas_moe.pallas_moe_ffn(x, idx, weights, SwiGLUClamp(LIMIT), 8, legs=plan)
        y = combine_copies(out, combine, jnp.float32)
        return jnp.sum(y * probe), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_leg_plans_match_float64_loops(name):
    x, idx, combine, w, probe = skewed_case()
    padded = idx.copy()
    padded[5, 1] = w.gate.shape[0]  # a copy of "no expert": zero output, no gradient
    (_, y), grads = value_and_grads(PLANS[name])(x, combine, w, padded, probe)
    kept = padded < w.gate.shape[0]
    want_y, _ = np_routed_experts(x, idx, combine * kept, *w, LIMIT)
    want = np_routed_experts_grads(x, idx, combine * kept, *w, probe, LIMIT, False)
    assert rel_error(y, want_y) < 1e-5
    for what, got, expected in zip(["x", "combine", "gate", "up", "down"],
                                   jax.tree.leaves(grads), want):
        if what == "combine":  # the padding copy's weight meets a zero output
            assert np.asarray(got)[5, 1] == 0
            expected = expected * kept
        assert rel_error(got, expected) < 1e-5, what
    for what, got in zip(["gate", "up", "down"], grads[2]):
        assert np.all(np.asarray(got)[[1, 2]] == 0), what  # experts without tokens


# ---- the choice table --------------------------------------------------------------------------

H100 = table.Device("gpu", "NVIDIA H100 80GB HBM3", True, "0.11")
A100 = table.Device("gpu", "NVIDIA A100-SXM4-80GB", False, "0.11")


def test_rule_until_measured():
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert [table.rule(leg, bf16, H100).backend for leg in ("fwd", "dx", "dw")] == \
        ["mosaic_gpu", "mosaic_gpu", "triton"]
    assert {table.rule(leg, f32, H100).backend for leg in ("fwd", "dx", "dw")} == {"triton"}
    assert table.rule("fwd", bf16, A100).backend == "triton"
    for platform in ("tpu", "cpu"):
        assert table.rule("dw", bf16, table.Device(platform, "x", False, "0.11")).backend == \
            "mosaic_tpu"


def test_measured_rows_win_for_their_device_jax_and_dtype():
    def row(k, n, backend, config=None, device=H100.kind, jax_version="0.11", dtype="bfloat16"):
        return table.Row(device, jax_version, dtype, "dw", k, n, backend, config, 400.0, "test")

    rows = (row(1536, 1024, "mosaic_gpu", tuple(DEFAULT_BLOCKS)), row(512, 1536, "xla"),
            row(1536, 1024, "xla", device="NVIDIA H200"),
            row(1536, 1024, "xla", jax_version="0.12"), row(1536, 1024, "xla", dtype="float16"))
    exact = table.choose("dw", 1536, 1024, jnp.bfloat16, H100, rows)
    assert exact == LegChoice("mosaic_gpu", tuple(DEFAULT_BLOCKS))
    assert table.choose("dw", 500, 1500, jnp.bfloat16, H100, rows).backend == "xla"  # nearest
    assert table.choose("fwd", 1536, 1024, jnp.bfloat16, H100, rows).backend == "mosaic_gpu"
    assert table.choose("dw", 1536, 1024, jnp.float32, H100, rows).backend == "triton"  # rule
    with pytest.raises(ValueError, match="leg: expected one of"):
        table.choose("backward", 1, 1, jnp.bfloat16, H100, rows)
    with pytest.raises(ValueError, match="backend: expected one of"):
        LegPlan.uniform("cuda")


def test_committed_table_and_rows_added_by_a_sweep(monkeypatch):
    committed = json.loads(table.TABLE.read_text())
    assert committed["status"].startswith("unmeasured") and table.load_rows() == ()
    row = table.Row(H100.kind, H100.jax, "bfloat16", "fwd", 1536, 1024, "triton",
                    (64, 64, 128), 300.0, "test")
    monkeypatch.setattr(table, "_INSTALLED", [])
    table.install([row])
    assert table.choose("fwd", 1536, 1024, jnp.bfloat16, H100) == LegChoice("triton",
                                                                             (64, 64, 128))
    merged = table.merged_table([row], "measured")
    assert [table.Row.from_json(r) for r in json.loads(json.dumps(merged))["rows"]] == [row]


def test_moe_plan_fills_tiles_and_transposes_them_for_dx():
    plan = pallas_moe.expert_plan("triton", 1536, 512, jnp.bfloat16, 100, interpret=False)
    assert plan.gate_up.fwd.config == (128, 64, 128) and plan.down.dx.config == (128, 128, 64)
    assert plan.gate_up.dw.config == (128, 64, 128)
    measured = LegChoice("mosaic_gpu", tuple(DEFAULT_BLOCKS))
    kept = pallas_moe.expert_plan(LegPlan(measured, measured, LegChoice("xla")), 8, 4,
                                  jnp.bfloat16, 8, interpret=True)
    assert kept.down == LegPlan(measured, measured, LegChoice("xla"))
