"""Small run configs and synthetic batches shared by the training tests."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from train.config import load_run_config

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
# XLA:CPU's elemental emitters instead of its MLIR fusion emitters: the same HLO compiles about
# 3x faster (a small train step: 19 s -> 6 s on 2 cores); the tests compare numbers, not speed.
FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False}  # jax.jit(..., compiler_options=...)
# XLA_FLAGS of the tests' JAX subprocesses: LLVM -O0 as tests/conftest.py, and FAST_COMPILE.
SUBPROCESS_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def run_device_worker(worker: Path, devices: int, *args: str, xla_flags: str = "") -> dict:
    """Runs the script `worker` in a subprocess that sees `devices` CPU devices (the flag must
    be set before JAX starts) and sharing the tests' compilation cache -> the JSON object its
    last stdout line prints; a failing worker fails the test with the end of its stderr.
    `xla_flags`: more XLA flags for the worker."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} "
                        f"{SUBPROCESS_XLA_FLAGS} {xla_flags}".rstrip(),
           "JAX_COMPILATION_CACHE_DIR": str(
               Path(tempfile.gettempdir()) / f"stepjax-test-xla-cache-{os.getuid()}")}
    done = subprocess.run([sys.executable, str(worker), *args], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

# Every feature of tiny.yaml (F/S layout, dense + MoE layers, clamps, MTP) at test sizes.
SMALL_MODEL = [
    "model.num_layers=5", "model.layout=F+SSSF", "model.d_model=32", "model.window=8",
    "model.head_dim=8", "model.dense_hidden=64", "model.moe.expert_hidden=16",
    "model.moe.shared_hidden=16", "model.moe.num_experts=8", "model.moe.top_k=2",
    "model.swiglu_limits=[0, 0, 0, 0, 7.0]", "model.swiglu_limits_shared=[0, 0, 0, 0, 16.0]",
    "model.mtp.num_heads=2",
]

# tiny.yaml's layers as one scanned segment of 8 identical F-MoE layers, which
# mesh.pipeline=2 splits.
PIPELINABLE = ["model.num_layers=8", "model.layout=F*8", "model.num_dense_layers=0",
               "model.swiglu_limits=0", "model.swiglu_limits_shared=0"]


def small_run(*overrides, vocab: int = 64):
    return load_run_config(TINY, [*SMALL_MODEL, f"model.vocab_size={vocab}",
                                  "train.seq_len=16", "train.batch_size=4", "train.warmup_steps=2",
                                  "train.steps=10", "train.progress=false", "train.peak_flops=1e9",
                                  *overrides])


TINY_V4 = REPO / "configs" / "tiny_deepseek_v4.yaml"
# Every feature of tiny_deepseek_v4.yaml (W, C and H layers, mHC, a hash-routed MoE layer, the
# V4 losses, MTP) at test sizes.
SMALL_V4 = [
    "model.d_model=32", "model.num_layers=4", "model.layout=WCHC", "model.window=8",
    "model.shared_kv_attention.num_heads=2", "model.shared_kv_attention.head_dim=16",
    "model.shared_kv_attention.rope_dims=8", "model.shared_kv_attention.q_lora_rank=16",
    "model.shared_kv_attention.o_groups=2", "model.shared_kv_attention.o_lora_rank=8",
    "model.shared_kv_attention.csa_rate=2", "model.shared_kv_attention.hca_rate=4",
    "model.shared_kv_attention.index_heads=2", "model.shared_kv_attention.index_head_dim=8",
    "model.shared_kv_attention.index_topk=3", "model.shared_kv_attention.query_chunk=8",
    "model.hyper_connections.hc_mult=2", "model.moe.num_experts=4", "model.moe.top_k=2",
    "model.moe.expert_hidden=16", "model.moe.shared_hidden=16", "model.moe.num_ep_groups=1",
    "model.dense_hidden=32", "train.seq_len=32", "train.batch_size=4", "train.warmup_steps=2",
    "train.progress=false", "train.peak_flops=1e9", "train.sequence_balance_coef=1e-4",
]


def small_v4_run(*overrides, vocab: int = 64):
    return load_run_config(TINY_V4, [*SMALL_V4, f"model.vocab_size={vocab}", *overrides])


TINY_MIMO = REPO / "configs" / "tiny_mimo.yaml"
# Every feature of tiny_mimo.yaml (a full first layer with a dense FFN, then 5:1 SWA/full; 1 KV
# head full / 2 SWA, Q/K heads of 12 with 8-dim values, 4 rotary dims, sink on SWA only, value
# scale, no QK norm, MoE without a shared expert, an MTP head on an SWA block) at test sizes.
SMALL_MIMO = [
    "model.d_model=32", "model.num_layers=6", "model.layout=F+SSSSF", "model.window=9",
    "model.head_dim=12", "model.v_head_dim=8", "model.full_attention.num_heads=4",
    "model.swa_attention.num_heads=4", "model.dense_hidden=64", "model.moe.num_experts=4",
    "model.moe.top_k=2", "model.moe.expert_hidden=16", "model.moe.num_ep_groups=1",
    "train.seq_len=32", "train.batch_size=4", "train.warmup_steps=2", "train.progress=false",
    "train.peak_flops=1e9",
]


def small_mimo_run(*overrides, vocab: int = 64):
    return load_run_config(TINY_MIMO, [*SMALL_MIMO, f"model.vocab_size={vocab}", *overrides])


def synthetic_batch(num_micro: int, micro: int, length: int, vocab: int, seed: int = 0) -> dict:
    """[num_micro, micro, length] batch of two packed documents per row (first 3 tokens meta)."""
    rng = np.random.default_rng(seed)
    shape = (num_micro, micro, length)
    half = length // 2
    segments = np.where(np.arange(length) < half, 1, 2).astype(np.int32)
    positions = np.where(np.arange(length) < half, np.arange(length), np.arange(length) - half)
    return {
        "tokens": rng.integers(0, vocab, shape).astype(np.int32),
        "segment_ids": np.broadcast_to(segments, shape).copy(),
        "positions": np.broadcast_to(positions.astype(np.int32), shape).copy(),
        "meta_mask": np.broadcast_to(positions < 3, shape).copy(),
    }


# Sweep and recipe tests: the small model on the real corpus (the shipped 4096-token tokenizer),
# 3 steps. Both test files use exactly these settings, so they share one compiled train step.
SMALL_LOOP = [*SMALL_MODEL, "model.vocab_size=4096", "train.seq_len=16", "train.batch_size=4",
              "train.warmup_steps=1", "train.steps=3", "train.log_every=1", "train.eval_every=0",
              "train.eval_batches=1", "train.progress=false", "train.peak_flops=1e9"]
