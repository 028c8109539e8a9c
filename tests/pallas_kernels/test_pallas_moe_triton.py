"""The Triton (GPU) grouped matmuls in interpret mode on CPU, and their lowering for CUDA.

Expected values are float64 numpy loops written here, group by group and row by row, from the
definitions (gmm: row r of group g is lhs[r] @ rhs[g]; dlhs: dout[r] @ rhs[g].T; drhs[g]: the sum
over g's rows of outer(lhs[r], dout[r]); rows past sum(group_sizes) give 0 and add nothing).
Relative error is max|actual - expected| / max|expected|. Kernel outputs are also written into
NaN buffers aliased to the outputs (`out_init`): no NaN left means every element was written.
Tiles are tiny (8 rows, 16 wide) so groups straddle row tiles and M, K, N leave remainders.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_references import grouped_matmul_operands, numpy_grouped, rel_error

from model.layers.moe import routed_experts
from model.ops import pallas_moe
from model.ops.moe_dispatch import ExpertWeights
from model.ops.swiglu import SwiGLUClamp
from pallas_kernels import grouped_matmul_triton as triton
from pallas_kernels.grouped_matmul import Tiling, gmm, resolve_kernel

F32_TOL, BF16_TOL = 1e-5, 2e-2
TILES = Tiling(rows=8, contract=16, cols=16)
BACK_TILES = Tiling(TILES.rows, TILES.cols, TILES.contract)  # dlhs: contracts N, produces K
FAST = {"xla_backend_optimization_level": 0}

# name -> (group_sizes, M, K, N)
CASES = {
    # empty groups 1 and 3, groups straddling tiles, M = 45 with rows 37..44 in no group,
    # K = 24 and N = 20 not multiples of 16
    "mixed": ([10, 0, 13, 0, 14], 45, 24, 20),
    "one_group": ([0, 0, 40, 0], 40, 16, 32),  # one group over five row tiles
    "many_groups_per_tile": ([3, 1, 0, 2, 9, 5], 20, 16, 8),  # row tile 0 holds four groups
    "rows_past_groups": ([5, 7, 0], 30, 8, 16),  # rows 12..29 in no group
    "all_empty": ([0, 0, 0], 11, 16, 16),  # no routed row: zeros everywhere
}


def case_arrays(name, dtype):
    return grouped_matmul_operands(name, CASES[name], dtype)


@functools.lru_cache(maxsize=None)
def poisoned_kernels():
    """gmm, gmm with rhs transposed and tgmm, each writing into a NaN buffer."""

    def run(lhs, rhs, sizes, dout):
        nan = functools.partial(jnp.full, fill_value=jnp.nan, dtype=lhs.dtype)
        out = triton.gmm_call(lhs, rhs, sizes, tiling=TILES, interpret=True,
                              out_init=nan((lhs.shape[0], rhs.shape[2])))
        dlhs = triton.gmm_call(dout, rhs, sizes, transpose_rhs=True, tiling=BACK_TILES,
                               interpret=True, out_init=nan(lhs.shape))
        drhs = triton.tgmm(lhs, dout, sizes, tiling=TILES, interpret=True, out_init=nan(rhs.shape))
        return out, dlhs, drhs

    return jax.jit(run, compiler_options=FAST)


@functools.lru_cache(maxsize=None)
def through_vjp():
    def run(lhs, rhs, sizes, dout):
        out, vjp = jax.vjp(lambda a, b: gmm(a, b, sizes, tiling=TILES, interpret=True,
                                            kernel="triton"), lhs, rhs)
        return (out, *vjp(dout.astype(out.dtype)))

    return jax.jit(run, compiler_options=FAST)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_float64_loops(name):
    lhs, rhs, sizes, dout = case_arrays(name, jnp.float32)
    expected = numpy_grouped(lhs, rhs, dout, CASES[name][0])
    poisoned = poisoned_kernels()(lhs, rhs, sizes, dout)
    differentiated = through_vjp()(lhs, rhs, sizes, dout)
    for what, got, direct, want in zip(["out", "dlhs", "drhs"], differentiated, poisoned, expected):
        assert got.dtype == jnp.float32, what
        assert not np.any(np.isnan(np.asarray(direct))), f"{what}: unwritten elements"
        np.testing.assert_array_equal(np.asarray(got), np.asarray(direct), err_msg=what)
        if np.any(want):
            assert rel_error(got, want) < F32_TOL, what
        else:
            assert np.all(np.asarray(got) == 0), what
    total = int(np.sum(sizes))
    assert np.all(np.asarray(differentiated[0])[total:] == 0)  # rows in no group
    assert np.all(np.asarray(differentiated[1])[total:] == 0)
    for g in np.flatnonzero(np.asarray(sizes) == 0):  # unused expert: exactly 0
        assert np.all(np.asarray(differentiated[2])[g] == 0), g


def test_bfloat16_inputs():
    lhs, rhs, sizes, dout = case_arrays("mixed", jnp.bfloat16)
    expected = numpy_grouped(lhs, rhs, dout, CASES["mixed"][0])
    for what, got, want in zip(["out", "dlhs", "drhs"], through_vjp()(lhs, rhs, sizes, dout),
                               expected):
        assert got.dtype == jnp.bfloat16, what
        assert rel_error(got, want) < BF16_TOL, what


def test_nan_rows_outside_the_groups_do_not_leak():
    """Rows past sum(group_sizes) may hold anything (here NaN): outputs stay finite."""
    lhs, rhs, sizes, dout = case_arrays("rows_past_groups", jnp.float32)
    total = int(np.sum(sizes))
    lhs, dout = lhs.at[total:].set(jnp.nan), dout.at[total:].set(jnp.nan)
    expected = numpy_grouped(lhs[:total], rhs, dout[:total], CASES["rows_past_groups"][0])
    out, dlhs, drhs = through_vjp()(lhs, rhs, sizes, dout)
    assert np.all(np.asarray(out)[total:] == 0) and np.all(np.asarray(dlhs)[total:] == 0)
    assert rel_error(out[:total], expected[0]) < F32_TOL
    assert rel_error(dlhs[:total], expected[1]) < F32_TOL
    assert rel_error(drhs, expected[2]) < F32_TOL


def test_kernel_choice_follows_the_backend(monkeypatch):
    assert resolve_kernel(None) == "mosaic"  # CPU: the TPU kernels in interpret mode
    assert resolve_kernel("triton") == "triton"
    with pytest.raises(ValueError, match="kernel"):
        resolve_kernel("cuda")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_kernel(None) == "triton"


def test_moe_ffn_on_triton_kernels_matches_sorted_dispatch():
    """`moe_impl=pallas` with the Triton kernels (interpret mode) against `sorted`: outputs and
    the gradients of x, the router weights and the three expert weights; experts 0 and 3 get no
    token, and the SwiGLU clamp binds."""
    rng = np.random.default_rng(3)
    n, e, k, d, f, limit, block = 15, 5, 2, 8, 12, 0.5, 8
    idx = np.stack([rng.choice([1, 2, 4], size=k, replace=False) for _ in range(n)])
    x = rng.normal(size=(n, d)).astype(np.float32)
    combine = rng.uniform(0.2, 1.5, size=(n, k)).astype(np.float32)
    w = ExpertWeights(*(rng.normal(size=s).astype(np.float32) * 2 / np.sqrt(s[1]) for s in
                        ((e, d, f), (e, d, f), (e, f, d))))

    def loss(x, combine, w, impl):
        if impl == "pallas":
            out, _ = pallas_moe.pallas_moe_ffn(x, idx, w, SwiGLUClamp(limit), block,
                                               legs="triton")
            y = jnp.einsum("nkd,nk->nd", out, combine)
        else:
            y, _ = routed_experts(x, idx, combine, w, clamp=SwiGLUClamp(limit), impl=impl,
                                  block_size=block)
        return jnp.sum(y * jnp.arange(d, dtype=jnp.float32)), y

    grads = {impl: jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3,
                           compiler_options=FAST)(x, combine, w, impl)
             for impl in ("pallas", "sorted")}
    (got, y), (want, ref_y) = grads["pallas"], grads["sorted"]
    assert rel_error(y, np.asarray(ref_y, np.float64)) < F32_TOL
    for what, a, b in zip(["x", "combine", "gate", "up", "down"], jax.tree.leaves(got),
                          jax.tree.leaves(want)):
        assert rel_error(a, np.asarray(b, np.float64)) < F32_TOL, what
    for what, a in zip(["gate", "up", "down"], got[2]):
        assert np.all(np.asarray(a)[[0, 3]] == 0), what


def test_moe_tiling_rounds_rows_for_compiled_triton():
    assert pallas_moe.moe_tiling("triton", 100, interpret=False) == Tiling(128, 64, 128)
    assert pallas_moe.moe_tiling("triton", 4, interpret=False).rows == 16
    assert pallas_moe.moe_tiling("triton", 12, interpret=True).rows == 12
    assert pallas_moe.moe_tiling("mosaic_tpu", 12, interpret=False).rows == 16


# ---- lowering (no GPU here: lower for CUDA without compiling) ---------------------------------


# One step's operand tiles at the default tiles (128, 64, 128), which dlhs uses too: gmm and
# dlhs (128 + 128) x 64, tgmm 128 x (64 + 128) elements; 32 and 48 KiB in bfloat16 (3 stages
# fit 160 KiB), 64 and 96 KiB in float32 (2 and 1 stages).
@pytest.mark.parametrize("dtype,stages", [(jnp.bfloat16, [3, 3, 3]), (jnp.float32, [2, 2, 1])])
def test_lowers_to_triton_for_cuda(dtype, stages):
    """Forward, dlhs and drhs go through the Pallas Triton lowering at an MoE-like shape with
    M and K not multiples of the default tiles (128, 64, 128)."""

    def step(lhs, rhs, sizes):
        out, vjp = jax.vjp(lambda a, b: gmm(a, b, sizes, interpret=False, kernel="triton"),
                           lhs, rhs)
        return out, vjp(out)

    args = (jax.ShapeDtypeStruct((1000, 1000), dtype), jax.ShapeDtypeStruct((6, 1000, 640), dtype),
            jax.ShapeDtypeStruct((6,), jnp.int32))
    text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3
    for name in ("gmm_triton", "tgmm_triton"):
        assert name in text, name
    assert text.count("num_warps = 4 : i32") == 3
    for depth in set(stages):
        assert text.count(f"num_stages = {depth} : i32") == stages.count(depth), depth
    # gmm: S = cdiv(1000, 128) + 6 - 1 = 13 visits x cdiv(640, 128) column tiles
    assert "grid_x = 13 : i32, grid_y = 5 : i32" in text
    # tgmm: 6 groups x cdiv(1000, 64) x cdiv(640, 128)
    assert "grid_x = 6 : i32, grid_y = 16 : i32, grid_z = 5 : i32" in text


def test_pipeline_depth_fits_shared_memory():
    assert triton.num_stages(48 * 1024) == 3
    assert triton.num_stages(80 * 1024) == 2  # 256-row dlhs tiles in bfloat16
    assert triton.num_stages(96 * 1024) == 1
    assert triton.num_stages(400 * 1024) == 1


def test_compiled_tiles_must_be_powers_of_two():
    args = (jax.ShapeDtypeStruct((64, 256), jnp.float32),
            jax.ShapeDtypeStruct((2, 256, 256), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32))
    with pytest.raises(ValueError, match="tiling.contract=96"):
        jax.jit(lambda a, b, s: gmm(a, b, s, tiling=(64, 96, 128), interpret=False,
                                    kernel="triton")).trace(*args).lower(
            lowering_platforms=("cuda",))
    with pytest.raises(ValueError, match="tiling.rows=8"):
        jax.jit(lambda a, b, s: gmm(a, b, s, tiling=(8, 64, 128), interpret=False,
                                    kernel="triton")).trace(*args).lower(
            lowering_platforms=("cuda",))
