"""The Mosaic GPU (Hopper) grouped matmuls: JAX's upstream kernels as `grouped_matmul_mgpu` wraps
them, run in the Mosaic GPU interpreter on CPU and lowered for CUDA without a GPU.

Expected values are the float64 loops of tests/moe_references.py (row r of group g is
lhs[r] @ rhs[g]; rows past sum(group_sizes) give 0). In the interpreter M, K and N are off the
64-wide blocks (100 x 40 -> 72), so the wrapper's padding is exercised, groups straddle blocks,
one is empty and rows past the groups hold NaN. The weight-gradient kernel cannot run in the
0.10.2 interpreter (it reads the GPU's SM count and needs `layout_cast`): it is lowered only.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_references import grouped_matmul_operands, numpy_grouped, rel_error

from pallas_kernels import grouped_matmul_mgpu as mgpu
from pallas_kernels.grouped_matmul_mgpu import Blocks

SIZES = [30, 0, 41, 9]  # rows 80..99 in no group


@functools.lru_cache(maxsize=None)
def forward_and_input_gradient():
    def run(lhs, rhs, sizes, dout):
        out = mgpu.gmm(lhs, rhs, sizes, interpret=True)
        dlhs = mgpu.gmm(dout, rhs, sizes, transpose_rhs=True, interpret=True)
        return out, dlhs

    return jax.jit(run)


@pytest.mark.slow
def test_interpreted_gmm_matches_float64_loops():
    """float32 here (bfloat16 operands: the lowering test below)."""
    dtype, tolerance = jnp.float32, 1e-5
    lhs, rhs, sizes, dout = grouped_matmul_operands("mgpu", (SIZES, 100, 40, 72), dtype)
    total = sum(SIZES)
    lhs, dout = lhs.at[total:].set(jnp.nan), dout.at[total:].set(jnp.nan)
    want_out, want_dlhs, _ = numpy_grouped(lhs[:total], rhs, dout[:total], SIZES)
    out, dlhs = forward_and_input_gradient()(lhs, rhs, sizes, dout)
    for what, got, want in (("out", out, want_out), ("dlhs", dlhs, want_dlhs)):
        assert got.dtype == dtype, what
        assert np.all(np.asarray(got[total:], np.float32) == 0), what  # rows in no group
        assert rel_error(got[:total], want) < tolerance, what


def test_weight_gradient_refuses_the_interpreter():
    lhs, _, sizes, dout = grouped_matmul_operands("mgpu", (SIZES, 100, 40, 72), jnp.float32)
    with pytest.raises(NotImplementedError, match="lower it for CUDA"):
        mgpu.tgmm(lhs, dout, sizes, interpret=True)


@pytest.fixture
def sm_count(monkeypatch):
    """Upstream's transposed ragged dot sizes its persistent grid by `jax.devices()[0]
    .core_count`, which a CPU device lacks: its module sees a device with 132 SMs (an H100)."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as upstream

    class WithSMs:
        def __getattr__(self, name):
            return getattr(jax, name)

        def devices(self):
            return [types.SimpleNamespace(core_count=132)]

    monkeypatch.setattr(upstream, "jax", WithSMs())


def lowered_text(fn, *shapes) -> str:
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_three_legs_lower_to_mosaic_gpu_for_cuda(sm_count):
    """fwd, dx (transpose_rhs) and dw at MoE-like bfloat16 shapes with K = 1000 off block_k:
    each is one Mosaic GPU custom call on operands padded to the blocks."""
    m, k, n, e = 4096, 1000, 512, 8

    def legs(x, w, dy, sizes):
        return (mgpu.gmm(x, w, sizes), mgpu.gmm(dy, w, sizes, transpose_rhs=True),
                mgpu.tgmm(x, dy, sizes))

    bf16 = jnp.bfloat16
    text = lowered_text(legs, ((m, k), bf16), ((e, k, n), bf16), ((m, n), bf16),
                        ((e,), jnp.int32))
    signatures = [line.rpartition("} : ")[2] for line in text.splitlines()
                  if "stablehlo.custom_call @mosaic_gpu" in line]
    sizes = "tensor<8xi32>"
    assert signatures == [
        f"({sizes}, tensor<4096x1024xbf16>, tensor<8x1024x512xbf16>) -> tensor<4096x512xbf16>",
        f"({sizes}, tensor<4096x512xbf16>, tensor<8x1024x512xbf16>) -> tensor<4096x1024xbf16>",
        # dw: group sizes, starts, ends, block counts and block starts, then both operands
        f"({', '.join([sizes] * 5)}, tensor<4096x1024xbf16>, tensor<4096x512xbf16>) -> "
        "tensor<8x1024x512xbf16>",
    ]


def test_blocks_beyond_shared_memory_are_refused_when_lowering():
    """A sweep can drop configurations on CPU: 6 stages of 256 x 128 + 128 x 256 bfloat16 tiles
    (768 KiB) exceed the 227 KiB of shared memory per block of sm90."""
    bf16 = jnp.bfloat16
    big = Blocks(256, 256, 128, 6, 1)
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        lowered_text(lambda x, w, s: mgpu.gmm(x, w, s, blocks=big), ((1024, 512), bf16),
                     ((4, 512, 512), bf16), ((4,), jnp.int32))
