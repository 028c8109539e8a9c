"""What the implementation switches select (`tables.py`): attention cores and their VJP, MoE
dispatch (row permutations, per-expert grouped SwiGLU), the Pallas MoE glue, dense projections
and the SwiGLU activation, on plain arrays."""
