"""`attention_impl=pallas` on TPU: JAX's splash attention through our wrapper
(`pallas_kernels/splash_attention.py`), run in Pallas interpret mode on CPU.

Forward against the independent float64 loops of tests/attention_references.py, gradients (dq,
dk, dv, dsink) against autodiff of `pallas_kernels.reference.attention_reference` (plain jnp).
One case carries everything the families' layers need at once: GQA (2 query heads sharing one KV
head), a sliding window, two packed documents, a per-head sink, values narrower than the keys,
and a length (136) that pads to two 128-row blocks with the window crossing their boundary.
Interpret mode is slow (seconds per kernel call), so shapes are tiny and the full causal mask
is checked forward only. Lowering to Mosaic for TPU is checked by tests/test_lowering.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
from attention_references import assert_close, reference_attention

from model.ops.tables import ATTENTION
from pallas_kernels import attention, splash_attention
from pallas_kernels.reference import attention_reference
from pallas_kernels.target import lowering_for, target_backend

LENGTH, HEADS, KV_HEADS, HEAD_DIM, V_DIM, WINDOW = 136, 2, 1, 16, 8, 9


def _inputs():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, LENGTH, HEADS, HEAD_DIM))
    k = rng.normal(size=(1, LENGTH, KV_HEADS, HEAD_DIM))
    v = rng.normal(size=(1, LENGTH, KV_HEADS, V_DIM))
    segments = (np.arange(LENGTH) >= 50).astype(np.int32)[None]
    sink = rng.normal(size=(HEADS,))
    return [jnp.asarray(a, jnp.float32) for a in (q, k, v, sink)], jnp.asarray(segments)


def test_splash_attention_matches_the_references_with_window_segments_gqa_and_sink():
    (q, k, v, sink), segments = _inputs()
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(1, LENGTH, HEADS, V_DIM)),
                            jnp.float32)

    def loss(fn):
        def f(q, k, v, sink):
            out = fn(q, k, v, window=WINDOW, segment_ids=segments, sink=sink)
            return jnp.sum(out * cotangent), out
        return f

    @jax.jit
    def both(q, k, v, sink):
        splash = jax.value_and_grad(loss(splash_attention.splash_attention), (0, 1, 2, 3),
                                    has_aux=True)(q, k, v, sink)
        full = splash_attention.splash_attention(q, k, v[..., :HEAD_DIM // 2])
        return splash, full

    ((_, out), grads), full = both(q, k, v, sink)
    assert_close(out, reference_attention(q, k, v, WINDOW, segments, sink))
    assert_close(full, reference_attention(q, k, v[..., :HEAD_DIM // 2]))

    # reference gradients by autodiff of the plain-jnp definition (values padded to D: it takes
    # one head dim; the padding columns of the output are exactly zero and carry no cotangent)
    def padded_reference(q, k, v, *, window, segment_ids, sink):
        wide = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, HEAD_DIM - V_DIM)))
        return attention_reference(q, k, wide, window=window, segment_ids=segment_ids,
                                   sink=sink)[..., :V_DIM]

    want = jax.jit(jax.grad(lambda *a: loss(padded_reference)(*a)[0], (0, 1, 2, 3)))(
        q, k, v, sink)
    for name, got, expected in zip(("dq", "dk", "dv", "dsink"), grads, want):
        assert_close(got, expected, err_msg=name)


def test_pallas_attention_dispatches_splash_on_tpu_and_flash_elsewhere():
    assert target_backend() == "cpu"
    assert ATTENTION.resolve("pallas") is attention.flash_attention_core
    with lowering_for("tpu"):
        assert ATTENTION.resolve("pallas") is splash_attention.splash_attention_core
    with lowering_for("cuda"):
        assert target_backend() == "gpu"
        assert ATTENTION.resolve("pallas") is attention.flash_attention_core
    assert target_backend() == "cpu"
