"""remat_policy=dots_with_kernels keeps the named kernel outputs (pallas_kernels/saved_names.py)
for the backward pass, which `dots` recomputes: the residuals JAX saves for a two-layer model
(one full and one sliding-window layer, both MoE; scan off, so each residual keeps its name)
with the `xla` attention core or the Pallas (Triton, interpreted) flash kernel,
read from `jax.ad_checkpoint.print_saved_residuals` (tracing only, nothing compiles).
That it changes nothing computed: tests/model/test_model_variants.py (every remat policy)."""

import contextlib
import io
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from model import CausalLM, load_config
from pallas_kernels.saved_names import KERNEL_OUTPUTS


def two_layer_lm(*overrides):
    return CausalLM(load_config("configs/tiny.yaml", [
        "num_layers=2", "layout=FS", "num_dense_layers=0", "d_model=32", "head_dim=8",
        "vocab_size=64", "moe.num_experts=4", "moe.top_k=2", "moe.expert_hidden=16",
        "moe.shared_hidden=16", "moe.num_ep_groups=1", "mtp.num_heads=0",
        "swiglu_limits=[0, 7.0]", "swiglu_limits_shared=0", *overrides]))


def loss_of(lm, variables, tokens):
    def loss(params):
        return jnp.mean(jnp.square(lm.apply({**variables, "params": params}, tokens).logits))

    return loss


def saved_names(moe_impl: str, attention_impl: str, policy: str) -> set[str]:
    lm = two_layer_lm("scan_layers=false", f"moe_impl={moe_impl}",
                      f"attention_impl={attention_impl}", f"remat_policy={policy}")
    tokens = jnp.zeros((1, 8), jnp.int32)
    variables = nn.meta.unbox(jax.eval_shape(lambda: lm.init(jax.random.key(0), tokens)))
    loss = loss_of(lm, variables, tokens)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        jax.ad_checkpoint.print_saved_residuals(loss, variables["params"])
    return set(re.findall(r"named '(\w+)'", printed.getvalue()))


@pytest.mark.parametrize("moe_impl,attention_impl",
                         [("sorted", "xla"), ("ragged_dot", "xla"), ("pallas", "pallas")])
def test_names_policy_saves_expert_and_attention_outputs(moe_impl, attention_impl):
    assert saved_names(moe_impl, attention_impl, "dots_with_kernels") >= set(KERNEL_OUTPUTS)
    assert not saved_names(moe_impl, attention_impl, "dots") & set(KERNEL_OUTPUTS)

