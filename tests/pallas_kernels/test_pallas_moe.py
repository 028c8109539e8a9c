"""Pallas grouped matmuls and `moe_impl=pallas` (interpret mode on CPU) against references.

Expected values: `pallas_kernels.reference` (gmm / tgmm as one masked matmul per group, the
routed FFN copy by copy; gradients by autodiff of the reference) and the model's own `sorted`
dispatch. Relative error is max|actual - expected| / max|expected|: < 1e-5 in float32, < 2e-2
with bfloat16 inputs (the kernels accumulate in float32 and round the result to bfloat16).

Unwritten outputs: kernel outputs are checked with a NaN buffer aliased to the output
(`out_init`), so "no NaN" means every element was written; `test_poisoned_output_exposes_
unwritten_blocks` shows that a schedule which skips blocks does leave NaN behind. Tiles are tiny
(8 rows, 16 wide) so the shapes below straddle group boundaries, leave K/N remainders and have
M not a multiple of the row tile.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_references import grouped_matmul_operands, rel_error

from model.layers.moe import routed_experts
from model.ops.moe_dispatch import (
    ExpertWeights,
    dispatch_rows,
    finalize_statistics,
    return_rows,
)
from model.ops.pallas_moe import pallas_moe_ffn
from model.ops.swiglu import SwiGLUClamp
from pallas_kernels.grouped_matmul import (
    Tiling,
    gmm,
    gmm_call,
    make_schedule,
    schedule_size,
    tgmm,
)
from pallas_kernels.reference import gmm_reference, moe_ffn_reference, tgmm_reference

F32_TOL, BF16_TOL = 1e-5, 2e-2
TILES = Tiling(rows=8, contract=16, cols=16)
# LLVM -O0 roughly halves XLA:CPU compile time of these small programs; same HLO is computed.
FAST = {"xla_backend_optimization_level": 0}


def fast_jit(fn, **kwargs):
    return jax.jit(fn, compiler_options=FAST, **kwargs)


# ---- schedule ----------------------------------------------------------------------------------


def brute_force_visits(group_sizes, num_rows, tm):
    """(group, tile) pairs whose rows intersect, found by testing every pair."""
    ends = np.cumsum(group_sizes)
    starts = ends - group_sizes
    num_tiles = -(-num_rows // tm)
    return {(g, t) for g in range(len(group_sizes)) for t in range(num_tiles)
            if max(starts[g], t * tm) < min(ends[g], (t + 1) * tm)}


@functools.lru_cache(maxsize=None)
def _jit_schedule(num_rows, tm, visit_empty_groups):
    return fast_jit(functools.partial(make_schedule, num_rows=num_rows, row_tile=tm,
                                      visit_empty_groups=visit_empty_groups))


def _check_schedule(group_sizes, num_rows, tm, visit_empty_groups):
    num_groups, num_tiles = len(group_sizes), -(-num_rows // tm)
    sched = _jit_schedule(num_rows, tm, visit_empty_groups)(jnp.asarray(group_sizes, jnp.int32))
    size = schedule_size(num_rows, tm, num_groups)
    assert size == num_tiles + num_groups - 1
    assert sched.visit_group.shape == sched.visit_tile.shape == (size,)
    count = int(sched.num_visits)
    assert 1 <= count <= size
    groups = np.asarray(sched.visit_group)
    tiles = np.asarray(sched.visit_tile)
    visits = list(zip(groups[:count].tolist(), tiles[:count].tolist()))
    # padding entries repeat the last real visit
    assert np.all(groups[count:] == groups[count - 1]) and np.all(tiles[count:] == tiles[count - 1])
    assert np.all((tiles[:count] >= 0) & (tiles[:count] < num_tiles))
    np.testing.assert_array_equal(np.asarray(sched.group_offsets),
                                  np.concatenate([[0], np.cumsum(group_sizes),
                                                  [np.sum(group_sizes)]]))

    real = [(g, t) for g, t in visits if g < num_groups and group_sizes[g] > 0]
    assert len(real) == len(set(real))
    assert set(real) == brute_force_visits(group_sizes, num_rows, tm)
    extra = [(g, t) for g, t in visits if not (g < num_groups and group_sizes[g] > 0)]
    if visit_empty_groups:  # tgmm: each empty group exactly once, so its output gets written
        assert sorted(g for g, _ in extra) == [g for g in range(num_groups) if group_sizes[g] == 0]
        # a group's visits are consecutive (its accumulator lives across them)
        assert all(groups[i] <= groups[i + 1] for i in range(count - 1))
    else:  # gmm: every row tile visited, null visits (group E) exactly for tiles without rows
        covered = {t for _, t in real}
        assert sorted(t for _, t in extra) == sorted(set(range(num_tiles)) - covered)
        assert all(g == num_groups for g, _ in extra)
        # a tile's visits are consecutive (the output tile stays resident across them)
        assert all(tiles[i] <= tiles[i + 1] for i in range(count - 1))
    return count


def test_schedule_matches_brute_force_enumeration():
    rng = np.random.default_rng(0)
    num_groups, num_rows = 6, 40  # fixed shapes: one compile per (row tile, mode)
    for trial in range(36):
        tm = [1, 3, 8][trial % 3]
        sizes = rng.integers(0, 12, size=num_groups) * (rng.random(num_groups) < 0.7)
        while sizes.sum() > num_rows:
            sizes[rng.integers(num_groups)] //= 2
        if trial % 4 == 0:  # every row in some group
            sizes[-1] += num_rows - sizes.sum()
        for visit_empty_groups in (False, True):
            _check_schedule(sizes.astype(np.int32), num_rows, tm, visit_empty_groups)


def test_schedule_bound_is_reached():
    # every group boundary falls inside a tile: T + E - 1 visits, the static schedule length
    sizes, tm = np.array([5, 8, 8, 8, 3], np.int32), 8  # 32 rows, boundaries at 5, 13, 21, 29
    assert _check_schedule(sizes, 32, tm, False) == schedule_size(32, tm, 5) == 8
    assert _check_schedule(sizes, 32, tm, True) == 8


# ---- gmm / tgmm --------------------------------------------------------------------------------

# name -> (group_sizes, M, K, N)
GMM_CASES = {
    # straddling tiles, empty groups (1, 3), M = 37 (not a multiple of 8), K = 24 and N = 20
    # (not multiples of 16: the contracted K remainder must be masked)
    "mixed": ([10, 0, 13, 0, 14], 37, 24, 20),
    "one_group": ([0, 0, 40, 0], 40, 16, 32),  # all rows to one expert, five row tiles
    "many_groups_per_tile": ([3, 1, 0, 2, 9, 5], 20, 16, 8),  # tile 0 holds four groups
    "rows_past_groups": ([5, 7, 0], 30, 8, 16),  # rows 12..29 in no group: output 0
    "leading_empty": ([0, 0, 6, 11], 17, 32, 16),
}


def _gmm_case(name, dtype):
    return grouped_matmul_operands(name, GMM_CASES[name], dtype)


@functools.lru_cache(maxsize=None)
def _poisoned_kernels():
    """The three kernel calls of gmm's forward and backward, each writing into a NaN buffer."""

    def run(lhs, rhs, sizes, dout):
        m, k = lhs.shape
        nan = functools.partial(jnp.full, fill_value=jnp.nan, dtype=lhs.dtype)
        out = gmm_call(lhs, rhs, sizes, tiling=TILES, out_init=nan((m, rhs.shape[2])))
        dlhs = gmm_call(dout, rhs, sizes, transpose_rhs=True, out_init=nan((m, k)),
                        tiling=Tiling(TILES.rows, TILES.cols, TILES.contract))
        drhs = tgmm(lhs, dout, sizes, tiling=TILES, out_init=nan(rhs.shape))
        return out, dlhs, drhs

    return fast_jit(run)


@functools.lru_cache(maxsize=None)
def _gmm_vjp(kind):
    fn = gmm_reference if kind == "reference" else functools.partial(gmm, tiling=TILES)

    def run(lhs, rhs, sizes, dout):
        out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
        return (out, *vjp(dout.astype(out.dtype)))

    return fast_jit(run)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GMM_CASES))
def test_gmm_forward_and_gradients_match_reference_float32(name):
    lhs, rhs, sizes, dout = _gmm_case(name, jnp.float32)
    expected = _gmm_vjp("reference")(lhs, rhs, sizes, dout)
    poisoned = _poisoned_kernels()(lhs, rhs, sizes, dout)
    through_vjp = _gmm_vjp("pallas")(lhs, rhs, sizes, dout)
    for what, got, poison_run, ref in zip(["out", "dlhs", "drhs"], through_vjp, poisoned,
                                          expected):
        assert got.dtype == jnp.float32 and got.shape == ref.shape, what
        assert not np.any(np.isnan(np.asarray(poison_run))), f"{what}: unwritten elements"
        # the custom_vjp runs exactly these kernels
        np.testing.assert_array_equal(np.asarray(got), np.asarray(poison_run), err_msg=what)
        assert rel_error(got, ref) < F32_TOL, what
    # tgmm against its own reference as well (not only through autodiff of gmm's)
    assert rel_error(poisoned[2], tgmm_reference(lhs, dout, sizes)) < F32_TOL
    # reference drhs of an unused expert is 0 by construction; the kernel's must be exactly 0
    drhs = np.asarray(through_vjp[2])
    for g in np.flatnonzero(np.asarray(sizes) == 0):
        assert np.all(drhs[g] == 0), g
    # rows past the last group: output and dlhs exactly 0
    total = int(np.sum(sizes))
    assert np.all(np.asarray(through_vjp[0])[total:] == 0)
    assert np.all(np.asarray(through_vjp[1])[total:] == 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixed", "many_groups_per_tile"])
def test_gmm_bfloat16(name):
    lhs, rhs, sizes, dout = _gmm_case(name, jnp.bfloat16)
    expected = _gmm_vjp("reference")(lhs, rhs, sizes, dout)  # float32 math on bf16 inputs
    poisoned = _poisoned_kernels()(lhs, rhs, sizes, dout)
    through_vjp = _gmm_vjp("pallas")(lhs, rhs, sizes, dout)
    for what, got, poison_run, ref in zip(["out", "dlhs", "drhs"], through_vjp, poisoned,
                                          expected):
        assert got.dtype == jnp.bfloat16, what
        assert not np.any(np.isnan(np.asarray(poison_run.astype(jnp.float32)))), what
        assert rel_error(got, ref) < BF16_TOL, what
        assert rel_error(poison_run, ref) < BF16_TOL, what


def test_poisoned_output_exposes_unwritten_blocks():
    """A tgmm schedule that skips the empty groups leaves their NaN in place: the poison works."""
    lhs, _, sizes, dout = _gmm_case("mixed", jnp.float32)
    skipping = make_schedule(sizes, lhs.shape[0], TILES.rows, visit_empty_groups=False)
    out = fast_jit(lambda a, b, s, sched: tgmm(
        a, b, s, tiling=TILES, schedule=sched,
        out_init=jnp.full((5, a.shape[1], b.shape[1]), jnp.nan)))(lhs, dout, sizes, skipping)
    nan_groups = np.isnan(np.asarray(out)).all(axis=(1, 2))
    np.testing.assert_array_equal(nan_groups, np.asarray(sizes) == 0)


def test_gmm_default_tiling_single_tile():
    # interpret-mode default tiles (128) shrink to the whole (small) array: one block per dim
    lhs, rhs, sizes, _ = _gmm_case("mixed", jnp.float32)
    got = fast_jit(lambda a, b, s: gmm(a, b, s))(lhs, rhs, sizes)
    assert rel_error(got, gmm_reference(lhs, rhs, sizes)) < F32_TOL


def test_kernels_lower_to_mosaic_for_tpu():
    """Lowering (Pallas -> Mosaic MLIR) needs no TPU; compiling it does and is not checked here."""

    def step(lhs, rhs, sizes):
        out, vjp = jax.vjp(lambda a, b: gmm(a, b, sizes, tiling=(128, 512, 256),
                                            interpret=False), lhs, rhs)
        return out, vjp(out)

    for dtype in (jnp.bfloat16, jnp.float32):
        args = (jax.ShapeDtypeStruct((1000, 1280), dtype),  # M, K not multiples of the tiles
                jax.ShapeDtypeStruct((6, 1280, 640), dtype), jax.ShapeDtypeStruct((6,), jnp.int32))
        text = jax.jit(step).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        assert text.count("tpu_custom_call") == 3  # gmm, gmm (rhs transposed), tgmm
    bad = (jax.ShapeDtypeStruct((64, 256), jnp.float32),
           jax.ShapeDtypeStruct((2, 256, 256), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32))
    with pytest.raises(ValueError, match="contract=100"):
        jax.jit(lambda a, b, s: gmm(a, b, s, tiling=(64, 100, 128), interpret=False)).trace(
            *bad).lower(lowering_platforms=("tpu",))


# ---- permute / unpermute -----------------------------------------------------------------------


def test_dispatch_and_return_rows():
    rng = np.random.default_rng(1)
    n, k, e, d = 9, 3, 5, 4
    idx = np.stack([rng.choice(e, size=k, replace=False) for _ in range(n)]).astype(np.int32)
    idx[4, 1] = e  # one copy of "no expert": sorted last, past the group sizes
    x = rng.normal(size=(n, d)).astype(np.float32)
    rows, dispatch = jax.jit(dispatch_rows, static_argnums=2)(jnp.asarray(x), jnp.asarray(idx), e)
    # rows grouped by expert, token order kept inside a group (stable)
    expected_rows = [x[t] for g in range(e + 1) for t in range(n) for j in range(k)
                     if idx[t, j] == g]
    np.testing.assert_array_equal(np.asarray(rows), np.stack(expected_rows))
    np.testing.assert_array_equal(np.asarray(dispatch.copies.group_sizes),
                                  np.bincount(idx.ravel(), minlength=e + 1)[:e])
    # tag each sorted row with a value that identifies its (token, slot), then send it back
    tagged = jnp.asarray(np.repeat(np.asarray(dispatch.copies.order, np.float32)[:, None], d,
                                   axis=1))
    back = np.asarray(jax.jit(return_rows, static_argnums=2)(tagged, dispatch, k))
    np.testing.assert_array_equal(back[..., 0], np.arange(n * k).reshape(n, k))


# ---- pallas_moe_ffn ----------------------------------------------------------------------------


def _moe_case(name):
    """(x, indices, combine, ExpertWeights, limit, block_size); SwiGLU clamp on (limit 0.5)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    d_model, hidden, limit, block = 8, 12, 0.5, 8
    if name == "random":
        n, e, k = 20, 6, 2
        idx = np.stack([rng.choice(e, size=k, replace=False) for _ in range(n)])
    elif name == "empty_experts":  # experts 0, 2, 3, 5 receive nothing
        n, e, k = 12, 6, 2
        idx = np.stack([rng.choice([1, 4], size=k, replace=False) for _ in range(n)])
    elif name == "one_expert":  # 27 rows, one group spanning four row tiles
        n, e, k = 27, 4, 1
        idx = np.full((n, 1), 3)
    elif name == "skewed":  # 30 rows to expert 0, one each to 1..5; 35 rows
        n, e, k = 35, 6, 1
        idx = np.concatenate([np.zeros(30, int), np.arange(1, 6)])[rng.permutation(n)][:, None]
    else:
        raise KeyError(name)
    x = rng.normal(size=(n, d_model)).astype(np.float32)
    combine = rng.uniform(0.2, 1.5, size=(n, k)).astype(np.float32)
    weights = ExpertWeights(
        gate=(rng.normal(size=(e, d_model, hidden)) / np.sqrt(d_model)).astype(np.float32),
        up=(rng.normal(size=(e, d_model, hidden)) * 2 / np.sqrt(d_model)).astype(np.float32),
        down=(rng.normal(size=(e, hidden, d_model)) / np.sqrt(hidden)).astype(np.float32),
    )
    return x, idx.astype(np.int32), combine, weights, limit, block


@functools.lru_cache(maxsize=None)
def _moe_value_and_grad(impl, limit, block):
    def loss(x, combine, w, idx, probe):
        if impl == "pallas":
            out, sums = pallas_moe_ffn(x, idx, w, SwiGLUClamp(limit), block)
            y = jnp.einsum("nkd,nk->nd", out.astype(jnp.float32), combine)
            stats = finalize_statistics(sums, w.gate.shape[-1])
        else:
            y, stats = routed_experts(x, idx, combine, w, clamp=SwiGLUClamp(limit), impl=impl,
                                      block_size=block)
            out = None
        return jnp.sum(y * probe), (y, out, stats)

    return fast_jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["random", "empty_experts", "one_expert", "skewed"])
def test_pallas_moe_ffn_matches_sorted_dispatch(name):
    x, idx, combine, w, limit, block = _moe_case(name)
    probe = np.random.default_rng(2).normal(size=x.shape).astype(np.float32)
    (_, (y, copy_out, stats)), grads = _moe_value_and_grad("pallas", limit, block)(
        x, combine, w, idx, probe)
    (_, (ref_y, _, ref_stats)), ref_grads = _moe_value_and_grad("sorted", limit, block)(
        x, combine, w, idx, probe)

    assert copy_out.shape == (*idx.shape, x.shape[1]) and copy_out.dtype == jnp.float32
    expected_copies = moe_ffn_reference(jnp.asarray(x), jnp.asarray(idx), *w, limit)
    assert rel_error(copy_out, expected_copies) < F32_TOL
    assert rel_error(y, ref_y) < F32_TOL
    assert set(stats) == set(ref_stats)
    for key in ref_stats:
        np.testing.assert_allclose(np.asarray(stats[key]), np.asarray(ref_stats[key]),
                                   rtol=F32_TOL, atol=1e-6, err_msg=key)
    assert float(stats["expert_tokens"].sum()) == idx.size
    names = ["x", "combine", "gate", "up", "down"]
    for what, got, ref in zip(names, jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert rel_error(got, ref) < F32_TOL, what
    unused = np.bincount(idx.ravel(), minlength=w.gate.shape[0]) == 0
    for what, got in zip(["gate", "up", "down"], grads[2]):
        assert np.all(np.asarray(got)[unused] == 0), what
    # the clamp must bind, or this comparison would not test it
    unclamped = moe_ffn_reference(jnp.asarray(x), jnp.asarray(idx), *w, 0.0)
    assert rel_error(unclamped, expected_copies) > 1e-2
