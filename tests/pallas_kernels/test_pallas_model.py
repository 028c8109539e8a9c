"""A tiny model with the Pallas kernels (interpret mode) equals the XLA paths: loss and grads.

`moe_impl=pallas` runs either kernel family: Mosaic TPU (the CPU default) or Triton (a GPU's
choice, made here by replacing the kernel table's rule).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from train_helpers import FAST_COMPILE

from model import CausalLM, load_config
from pallas_kernels import grouped_leg_table
from pallas_kernels.grouped_legs import LegChoice


@pytest.mark.slow
@pytest.mark.parametrize("moe_kernel", ["mosaic_tpu", "triton"])
def test_tiny_model_pallas_impls_match_xla(monkeypatch, moe_kernel):
    monkeypatch.setattr(grouped_leg_table, "rule", lambda *_: LegChoice(moe_kernel))
    overrides = ["num_layers=3", "layout=FSS", "num_dense_layers=1", "d_model=32", "head_dim=8",
                 "vocab_size=64", "window=5", "moe.num_experts=4", "moe.top_k=2",
                 "moe.expert_hidden=16", "moe.shared_hidden=16", "moe.num_ep_groups=1",
                 "dense_hidden=32", "swiglu_limits=[0, 0, 0.5]", "swiglu_limits_shared=0",
                 "mtp.num_heads=1"]
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 64)
    base = load_config("configs/tiny.yaml", overrides)
    # Init and each loss-and-gradients run as one jitted program (eagerly, every op would be
    # compiled on its own: twice the CPU time).
    init = jax.jit(CausalLM(base).init, compiler_options=FAST_COMPILE)
    variables = nn.meta.unbox(init(jax.random.key(1), tokens))

    def loss_and_grads(impl_overrides):
        lm = CausalLM(load_config("configs/tiny.yaml", overrides + impl_overrides))

        def loss(params):
            out = lm.apply({**variables, "params": params}, tokens)
            return jnp.mean(jnp.square(out.logits)) + jnp.mean(jnp.square(out.mtp_logits[0]))

        return jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE)(
            variables["params"])

    xla_loss, xla_grads = loss_and_grads(["attention_impl=xla", "moe_impl=sorted"])
    pallas_loss, pallas_grads = loss_and_grads(["attention_impl=pallas", "moe_impl=pallas"])
    np.testing.assert_allclose(pallas_loss, xla_loss, rtol=1e-5)
    flat_xla = traverse_util.flatten_dict(xla_grads, sep="/")
    flat_pallas = traverse_util.flatten_dict(pallas_grads, sep="/")
    assert flat_xla.keys() == flat_pallas.keys()
    for name, expected in flat_xla.items():
        scale = max(float(np.max(np.abs(expected))), 1e-6)
        np.testing.assert_allclose(flat_pallas[name], expected, atol=2e-5 * scale, rtol=0,
                                   err_msg=name)
