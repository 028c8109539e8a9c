"""Names (`jax.ad_checkpoint.checkpoint_name`) of the kernel outputs that the `dots_with_kernels`
remat policy (model/layers/stack.py) saves for the backward pass.

`dots` saves only `dot_general` outputs, so everything a kernel computes (a `pallas_call` or a
Mosaic GPU call, `ragged_dot`) is recomputed in the backward pass: the whole expert forward and
the attention forward once more per layer. A name on a kernel's residual inside its custom VJP's
forward rule, or on its output, lets the policy keep it instead:

- EXPERT_GATE_UP: the routed experts' gate/up pre-activations [M, 2F] (model/ops/expert_swiglu);
- EXPERT_OUT: their outputs [M, D] before the combine (model/ops/pallas_moe);
- ATTENTION_CORE_OUT: the attention core's output [B, T, H, Dv] (model/layers/attention.py);
- ATTENTION_LSE: the attention core's softmax log-sum-exp, a residual of its backward pass;
  both named by `name_attention` in the forward rules of the `xla` core (model/ops/
  attention_vjp.py) and of the Triton and Mosaic GPU flash kernels (`cudnn`'s residuals live
  inside jax.nn.dot_product_attention, unnamed).
"""

from jax.ad_checkpoint import checkpoint_name

EXPERT_GATE_UP = "expert_gate_up"
EXPERT_OUT = "expert_out"
ATTENTION_CORE_OUT = "attention_core_out"
ATTENTION_LSE = "attention_lse"

KERNEL_OUTPUTS = (EXPERT_GATE_UP, EXPERT_OUT, ATTENTION_CORE_OUT, ATTENTION_LSE)


def name_attention(out, lse):
    """(out, lse) of an attention core's forward rule, named for the policy."""
    return checkpoint_name(out, ATTENTION_CORE_OUT), checkpoint_name(lse, ATTENTION_LSE)
