"""What `make gpu-check` (benchmarks.gpu.suite) runs: the accelerator plan, sized to finish in
about 8 minutes on one H100, and the dry run (tiny shapes, a couple of steps) for CPU.

Every section has a time limit: a section stops starting new cases past it (a compile or a
run already started is not interrupted) and a section starting after the overall budget is
skipped; both are recorded. The attention timing shapes and the MoE layer come from the train
config's model (one SWA and one full layer of it), so the kernels are timed at the shapes the
train step runs.
"""

from __future__ import annotations

import dataclasses

from benchmarks.gpu.checks import AttentionCase, MoECase
from benchmarks.gpu.timings import AttentionShape
from model.config import ModelConfig
from pallas_kernels.grouped_common import Tiling
from pallas_kernels.grouped_legs import LegChoice

# In the order they run, most wanted first: the per-leg kernel sweep before the train step,
# which uses its winners; the train step (the MFU figure) before the sections that add detail.
SECTIONS = ("checks", "legs", "train", "moe", "profile", "attention", "remat", "decode",
            "attention_sweep", "v4_layers")


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    attention_checks: tuple[AttentionCase, ...]
    moe_checks: tuple[MoECase, ...]
    attention_lengths: tuple[int, ...]  # timed context lengths
    attention_impls: tuple[str, ...]
    attention_batch: int
    attention_repeats: int
    moe_tokens: int  # tokens of the timed MoE layer
    moe_impls: tuple[str, ...]
    moe_rounds: int
    timing_dtype: str
    train_config: str
    train_overrides: tuple[str, ...]
    train_warmup: int
    train_steps: int
    decode_prompt: int
    decode_new_tokens: int
    decode_batches: tuple[int, ...]
    # untrained configs to decode: (label, config path, overrides)
    decode_others: tuple[tuple[str, str, tuple[str, ...]], ...]
    v4_cases: tuple[tuple[int, str], ...]  # (T, layer kind) of the v4_layers section, in order
    v4_dry_run: bool  # shrink the V4 layers (benchmarks.gpu.v4_layers.layer_config)
    limits: dict  # section -> seconds after which it starts no new case
    budget_s: float  # sections starting later than this are skipped
    legs_repeats: int = 10  # timed calls per grouped-matmul candidate
    legs_candidates: dict | None = None  # leg -> LegChoices; None: moe_legs.CANDIDATES
    profile_steps: int = 2
    remat_policy: str = "dots_with_kernels"  # timed against the train config's policy
    remat_steps: int = 10

    def with_changes(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)


def attention_shapes(cfg: ModelConfig) -> list[AttentionShape]:
    """One SWA and one full layer of `cfg`: (kind, query heads, KV heads, head dim, window)."""
    shapes = []
    for kind, layer_type, window in (("swa", "S", cfg.window), ("full", "F", None)):
        geo = cfg.attention_geometry(layer_type)
        shapes.append(AttentionShape(kind, geo.num_heads, geo.num_kv_heads, geo.head_dim, window))
    return shapes


# Tiny cases: float32, odd features on (segments, sink, the clamp; MoE widths off the kernel
# tiles); medium: bfloat16 at the shapes of configs/gpu_1b.yaml's layers (D = 128, GQA 18/12
# over 2 KV heads, W = 512).
ACCELERATOR = Plan(
    name="accelerator",
    attention_checks=(
        AttentionCase("tiny swa", 2, 128, 4, 2, 32, 32, True, True, "float32"),
        AttentionCase("tiny full", 2, 128, 4, 2, 32, None, True, True, "float32"),
        AttentionCase("medium swa", 1, 2048, 18, 2, 128, 512, True, False, "bfloat16"),
        AttentionCase("medium full", 1, 2048, 12, 2, 128, None, False, False, "bfloat16"),
        # cuDNN's sliding window and the sink folded from its lse; the Mosaic kernels' window
        AttentionCase("swa sink", 1, 2048, 16, 2, 128, 512, False, True, "bfloat16"),
        # MiMo-V2-Flash's head dims (Q/K 192, V 128), window, segments, sink
        AttentionCase("mimo dims", 1, 1024, 8, 2, 192, 128, True, True, "bfloat16", 128),
    ),
    moe_checks=(
        MoECase("tiny", 64, 32, 8, 2, 16, 1.0, "float32"),
        # D and F not multiples of the Triton grouped matmuls' tiles (64 / 128): masked edges
        MoECase("odd dims", 300, 200, 16, 2, 72, 7.0, "float32"),
        MoECase("medium", 4096, 1536, 32, 4, 512, 0.0, "bfloat16"),
    ),
    attention_lengths=(4096, 8192, 16384, 32768),
    # `pallas` runs the Mosaic GPU kernels on sm90; `pallas_triton` the Triton kernel beside it
    attention_impls=("pallas", "cudnn", "pallas_triton", "xla"),
    attention_batch=1,
    attention_repeats=5,
    moe_tokens=32768,
    moe_impls=("ragged_dot", "sorted", "pallas"),
    moe_rounds=10,
    timing_dtype="bfloat16",
    train_config="configs/gpu_1b.yaml",
    # warmup_steps: the peak learning rate within the few steps run (speed does not depend on it;
    # learning the data does, and the decode section's drafts are accepted only if it was
    # learnt). moe_impl: the Pallas Triton grouped matmuls (configs/gpu_1b.yaml keeps
    # `ragged_dot`, which XLA:GPU expands densely; the train section falls back to it if the
    # kernels fail).
    train_overrides=("train.warmup_steps=3", "model.moe_impl=pallas"),
    train_warmup=3,
    train_steps=20,
    decode_prompt=64,
    decode_new_tokens=64,
    decode_batches=(1, 32),
    decode_others=(("gpu_1b_mimo (random init)", "configs/gpu_1b_mimo.yaml", ()),
                   ("gpu_1b_deepseek_v4 (random init)", "configs/gpu_1b_deepseek_v4.yaml", ())),
    # 16k first (CSA vs dense there), then how CSA grows with T, then the rest
    v4_cases=((16384, "C"), (16384, "dense"), (8192, "C"), (65536, "C"), (32768, "C"),
              (16384, "H"), (16384, "W"), (65536, "dense")),
    v4_dry_run=False,
    # Expected on an H100, compiles included: checks ~90 s, legs <= 60 s (up to 48 kernel
    # compiles), train ~60 s (a ~45 s compile), moe ~25 s, profile ~15 s, attention ~90 s, remat
    # ~55 s, decode ~60 s: about 460 s, so the two sweeps after them start only with --budget
    # raised or --sections chosen. The train limit leaves room for its kernel fallbacks.
    limits={"checks": 90, "legs": 60, "train": 150, "moe": 45, "profile": 30, "attention": 100,
            "remat": 90, "decode": 75, "attention_sweep": 60, "v4_layers": 60},
    budget_s=480,
)

# The same sections at sizes that run in seconds on CPU: configs/tiny.yaml shrunk to two layers
# that keep its kinds (a full layer with a dense FFN, an SWA layer with MoE and clamps, an MTP
# head); compiling the train step is most of a dry run.
DRY_RUN = ACCELERATOR.with_changes(
    name="dry run",
    attention_checks=(
        AttentionCase("tiny swa", 1, 64, 4, 2, 16, 16, True, True, "float32"),
        AttentionCase("tiny full", 1, 64, 4, 2, 16, None, False, False, "float32"),
        AttentionCase("tiny mimo", 1, 64, 4, 2, 16, 16, False, True, "float32", 8),
    ),
    moe_checks=(MoECase("tiny", 32, 16, 4, 2, 8, 1.0, "float32"),),
    attention_lengths=(128,),
    attention_repeats=2,
    moe_tokens=128,
    moe_rounds=2,
    train_config="configs/tiny.yaml",
    train_overrides=(
        "model.num_layers=2", "model.layout=FS", "model.d_model=32", "model.window=8",
        "model.head_dim=8", "model.dense_hidden=64", "model.moe.expert_hidden=16",
        "model.moe.shared_hidden=16", "model.moe.num_experts=8", "model.moe.top_k=2",
        "model.swiglu_limits=[0, 7.0]", "model.swiglu_limits_shared=[0, 16.0]",
        "model.mtp.num_heads=1", "model.vocab_size=64", "train.seq_len=32", "train.batch_size=2",
        "train.warmup_steps=1",
    ),
    train_warmup=1,
    train_steps=2,
    decode_prompt=8,
    decode_new_tokens=8,
    decode_batches=(1,),
    decode_others=(),  # benchmarks.gpu.decode's untrained path: tests/test_gpu_suite.py
    v4_cases=((128, "W"),),  # a shrunken V4 sliding-window layer
    v4_dry_run=True,
    limits={"checks": 60, "legs": 30, "train": 60, "moe": 30, "profile": 30, "attention": 30,
            "remat": 60, "decode": 30, "attention_sweep": 30, "v4_layers": 30},
    budget_s=300,  # generous: a dry run is to run every section, on any machine
    legs_repeats=2,
    # One interpreted Pallas candidate, one that needs a Hopper GPU (skipped) and XLA's.
    legs_candidates={"fwd": (LegChoice("mosaic_gpu"), LegChoice("triton", Tiling(16, 16, 16)),
                             LegChoice("xla")),
                     "dx": (LegChoice("xla"),), "dw": (LegChoice("xla"),)},
    # tiny.yaml's own policy: the section skips a comparison with itself (its compile would be
    # the dry run's most expensive step); tests/test_gpu_suite.py runs it with a stubbed step
    remat_policy="none",
)
