"""When the `cudnn` attention core runs cuDNN's fused kernel, and why it falls back where not."""

import logging

import jax
import jax.numpy as jnp
import numpy as np

from model.ops import cudnn_attention as cudnn_core
from model.ops.attention_cores import xla_attention
from model.ops.cudnn_attention import cudnn_fallback_reason

H100, A100 = (9, 0), (8, 0)


def q(dtype=jnp.bfloat16, head_dim=128):
    return jax.ShapeDtypeStruct((1, 8, 2, head_dim), dtype)


def test_cudnn_is_chosen_only_on_gpus_for_what_its_kernel_expresses():
    """`implementation=None` would always run XLA's fallback (seen on an H200), so the core
    names cuDNN itself where the fused kernel takes the call, and says why where it does not."""
    segments = jnp.zeros((1, 8), jnp.int32)
    assert cudnn_fallback_reason(q(), None) == "no cuDNN on cpu"  # this machine
    for dtype, head_dim, cc in ((jnp.bfloat16, 128, H100), (jnp.float16, 64, A100),
                                (jnp.bfloat16, 192, H100), (jnp.bfloat16, 256, H100)):
        assert cudnn_fallback_reason(q(dtype, head_dim), None, backend="gpu", capability=cc) \
            is None
    cases = (((jnp.float32, 128), None, H100, "takes bfloat16/float16, got float32"),
             ((jnp.bfloat16, 128), segments, H100, "segment ids"),
             ((jnp.bfloat16, 192), None, A100,
              "head dim 192: cuDNN takes multiples of 8 up to 128"),
             ((jnp.bfloat16, 512), None, H100, "head dim 512"),  # DeepSeek-V4's shared KV
             ((jnp.bfloat16, 36), None, H100, "head dim 36"))
    for (dtype, head_dim), segment_ids, cc, reason in cases:
        got = cudnn_fallback_reason(q(dtype, head_dim), segment_ids, backend="gpu", capability=cc)
        assert got is not None and reason in got, (dtype, head_dim, got)


def test_a_gpu_fallback_runs_the_xla_core_and_says_why_once(monkeypatch, caplog):
    """On a GPU, what cuDNN cannot express (here float32) runs the `xla` core, not
    jax.nn.dot_product_attention's O(T^2) XLA path, with one logged line per reason."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(cudnn_core, "compute_capability", lambda: H100)
    monkeypatch.setattr(cudnn_core, "_NOTED", set())
    rng = np.random.default_rng(0)
    qa, ka, va = (jnp.asarray(rng.normal(size=s), jnp.float32)
                  for s in ((1, 16, 4, 8), (1, 16, 2, 8), (1, 16, 2, 8)))
    with caplog.at_level(logging.WARNING, logger=cudnn_core.__name__):
        for _ in range(2):
            got = cudnn_core.cudnn_attention(qa, ka, va, window=4, segment_ids=None, sink=None)
    np.testing.assert_array_equal(
        got, xla_attention(qa, ka, va, window=4, segment_ids=None, sink=None))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "float32" in lines[0] and "xla core" in lines[0]
