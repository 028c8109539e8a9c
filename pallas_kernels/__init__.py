"""Pallas kernels on plain arrays, with their jnp references; they import nothing of stepjax.

- `attention`: `attention_impl=pallas`, which picks a flash-attention family per device and
  input: `flash_attention_mgpu` (+ `_bwd`, `mgpu_attention_common`, block table
  `flash_attention_blocks`) on Mosaic GPU for sm90, `flash_attention` (Triton; interpret mode
  on CPU) elsewhere; causal / sliding-window with segment ids and sinks;
- `gpu_arch`: the NVIDIA compute capability kernel families are chosen by;
- `grouped_matmul`: grouped matmuls over row groups of one expert each (`moe_impl=pallas`,
  through `model.ops.pallas_moe`), Mosaic kernels for TPU and the differentiable `gmm` that
  picks a kernel family; `grouped_matmul_triton`: the same kernels in Triton for GPU;
  `grouped_common`: their shared visit schedule and tile roles;
- `reference`: plain-jnp versions of both, what the kernel tests compare against.

The model reaches them through `model.ops.tables`. On CPU they run in interpret mode (slow, for
validation); each module's docstring says which backends it lowers to.
"""
