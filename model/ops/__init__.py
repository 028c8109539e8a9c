"""What the implementation switches select (`tables.py`): attention cores, MoE dispatch, the
block-grouped matmul, the Pallas MoE glue and the SwiGLU activation, on plain arrays."""
