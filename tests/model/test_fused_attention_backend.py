"""Which kernel the `cudnn` attention core asks `jax.nn.dot_product_attention` for."""

import jax
import jax.numpy as jnp

from model.ops.attention_cores import fused_attention_backend


def test_cudnn_core_names_cudnn_only_on_gpu_for_inputs_its_kernel_takes(monkeypatch):
    """`implementation=None` would always run XLA's fallback (seen on an H200), so the `cudnn`
    core names cuDNN itself: on a GPU, for 16-bit q with a head dim <= 128 and divisible by 8."""
    def q(dtype, head_dim):
        return jax.ShapeDtypeStruct((1, 8, 2, head_dim), dtype)

    assert fused_attention_backend(q(jnp.bfloat16, 64)) == "xla"  # this CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert fused_attention_backend(q(jnp.bfloat16, 64)) == "cudnn"
    assert fused_attention_backend(q(jnp.float16, 128)) == "cudnn"
    assert fused_attention_backend(q(jnp.float32, 64)) == "xla"
    assert fused_attention_backend(q(jnp.bfloat16, 192)) == "xla"  # MiMo's D = 192
    assert fused_attention_backend(q(jnp.bfloat16, 36)) == "xla"
