"""The accelerator suite behind `make gpu-check` (`python -m benchmarks.gpu.suite`).

suite       the command: sections in order, the time budget, the report
plans       sizes of each section, on an accelerator and in the CPU dry run
checks, attention_checks, ep_check
            correctness of every attention and MoE implementation against XLA
mosaic_probe, moe_probe
            whether the Mosaic GPU kernels compile and run on this device, in a child process
moe_legs    the MoE's grouped-matmul legs per candidate kernel -> grouped_leg_table.json
training    the ~1B train step: tokens/s, MFU, memory; the remat comparison
timings     MoE layer and attention cores, timed per implementation
profiling   time per category from a jax.profiler trace
decode      tokens/s with and without MTP speculation
attention_sweep
            Mosaic GPU flash-attention block sizes -> flash_attention_blocks.json
v4_layers   DeepSeek-V4's CSA, HCA and sliding-window layers against dense attention
report, attention_report, attention_targets
            gpu_report.json / .md and its targets table
"""
