"""Pallas kernels on plain arrays, with their jnp references; they import nothing of stepjax.

- `attention`: `attention_impl=pallas`, which picks a flash-attention family per device and
  input: `flash_attention_mgpu` (+ `_bwd`, `mgpu_attention_common`, block table
  `flash_attention_blocks`) on Mosaic GPU for sm90, `flash_attention` (Triton; interpret mode
  on CPU) elsewhere; causal / sliding-window with segment ids and sinks; `splash_attention`:
  the same on TPU, JAX's splash attention (Mosaic) wrapped to the model's signature;
- `gpu_arch`: the NVIDIA compute capability kernel families are chosen by;
- grouped matmuls over row groups of one expert each (`moe_impl=pallas`, through
  `model.ops.pallas_moe`): `grouped_matmul`, Mosaic kernels for TPU and the differentiable `gmm`
  that picks a kernel family; `grouped_matmul_triton`, the same kernels in Triton for GPU;
  `grouped_common`, their shared visit schedule and tile roles; `grouped_matmul_mgpu`, JAX's
  Mosaic GPU (Hopper) kernels wrapped to the same semantics (`mosaic_gpu`: where they run, their
  CPU interpreter); `grouped_legs`, the forward / input-gradient / weight-gradient legs on any
  of these or `lax.ragged_dot`, and `grouped_leg_table` (+ .json), which family runs each leg;
- `saved_names`: the names of kernel outputs that `remat_policy=dots_with_kernels` keeps;
- `reference`: plain-jnp versions of both, what the kernel tests compare against;
- `target`: the backend being traced for (JAX's, or the platform a CPU host lowers for).

The model reaches them through `model.ops.tables`. On CPU they run in interpret mode (slow, for
validation); each module's docstring says which backends it lowers to.
"""
