"""Lowering for accelerators on this CPU machine, nothing compiled.

`python -m benchmarks.lowering`: the train and decode steps of the three tiny presets lower for
TPU with the Pallas kernels (splash attention and the Mosaic grouped matmuls). One subprocess
lowers all three at 2 x 128 tokens (one JAX start-up; the kernel choices follow the platform
while tracing, which JAX's jit cache does not key on, so whole steps are lowered apart from this
test process). The expert-parallel `ragged` all-to-all lowers for TPU and CUDA (fresh jitted
functions here)."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.lowering import abstract_mesh_context, collectives, kernel_calls, main
from model.ops.moe_dispatch import ExpertWeights
from model.ops.swiglu import SwiGLUClamp
from model.parallel.expert_parallel import expert_parallel_experts
from model.parallel.rules import abstract_mesh
from pallas_kernels.target import lowering_for

REPO = Path(__file__).resolve().parents[1]
PRESETS = ("configs/tiny.yaml", "configs/tiny_deepseek_v4.yaml", "configs/tiny_mimo.yaml")
SPLASH = {"splash_mha_fwd_segmented_residuals", "splash_mha_dq_segmented_no_residuals",
          "splash_mha_dkv_segmented_no_residuals"}  # forward and both backward kernels


@pytest.mark.slow
def test_tiny_presets_lower_for_tpu_with_mosaic_kernels():
    command = [sys.executable, "-m", "benchmarks.lowering", "--platform", "tpu", "--json",
               "--batch-size", "2", "--seq-len", "128", "model.attention_impl=pallas",
               "model.moe_impl=pallas"]
    for preset in PRESETS:
        command += ["--config", preset]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["platform"] == "tpu" and list(report["configs"]) == list(PRESETS)
    for preset, steps in report["configs"].items():
        train, decode = steps["train step"], steps["decode step"]
        mosaic = train["kernels"]["Mosaic (TPU)"]
        # every MoE layer's gmm (forward, dlhs) and tgmm (drhs) in the train step, gmm alone
        # in the decode step, and nothing lowered for another platform
        assert mosaic["gmm"] > 0 and mosaic["tgmm"] > 0, (preset, mosaic)
        assert set(decode["kernels"]) == {"Mosaic (TPU)"} and decode["kernels"][
            "Mosaic (TPU)"]["gmm"] > 0, (preset, decode)
        assert set(train["kernels"]) == {"Mosaic (TPU)"}, (preset, train["kernels"])
        # F/S attention runs splash; DeepSeek-V4's W/C/H layers have their own XLA attention
        has_splash = SPLASH <= set(mosaic)
        assert has_splash == (preset != "configs/tiny_deepseek_v4.yaml"), (preset, mosaic)


def test_kernel_calls_reads_custom_call_targets_and_names():
    text = "\n".join([
        '%0 = stablehlo.custom_call @tpu_custom_call(%a) {backend_config = "x", '
        'kernel_name = "gmm"} : ...',
        '%1 = stablehlo.custom_call @tpu_custom_call(%a) {kernel_name = "gmm"} : ...',
        '%2 = stablehlo.custom_call @__gpu$xla.gpu.triton(%b) {name = "flash_fwd"} : ...',
        '%3 = stablehlo.custom_call @Sharding(%c) : ...',  # an annotation, not a kernel
    ])
    assert kernel_calls(text) == {"Mosaic (TPU)": {"gmm": 2}, "Triton (GPU)": {"flash_fwd": 1}}


def test_bad_input_exits_2_before_tracing(capsys):
    assert main(["--platform", "tpu", "--config", "configs/tiny.yaml", "model.nope=1"]) == 2
    assert main(["--platform", "rocm", "--config", "configs/tiny.yaml"]) == 2
    assert main(["--platform", "tpu", "--config", "configs/tiny.yaml", "--mesh",
                 "expert=3"]) == 2
    assert main(["--platform", "cuda", "--config", "configs/tiny.yaml", "--gpu-capability",
                 "sm90"]) == 2
    # a micro-batch beyond int32 indexing, named before anything is traced
    assert main(["--platform", "tpu", "--config", "configs/tiny.yaml", "--seq-len",
                 "100000000000"]) == 2
    # a recipe or an RL YAML is named as what it is
    assert main(["--platform", "tpu", "--config", "configs/recipes/tiny_staged.yaml"]) == 2
    assert main(["--platform", "tpu", "--config", "configs/rl_arith.yaml"]) == 2
    assert main(["--platform", "tpu", "--config", "configs/tiny.yaml", "--decode-len",
                 "100000000000"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors[7] == ("error: --decode-len: must be in [1, 2147483647] (positions are "
                         "int32), got 100000000000"), errors[7]
    assert len(errors) == 8 and all(e.startswith("error: ") for e in errors), errors
    assert errors[4].startswith("error: train.seq_len: 8 x 100000000000 tokens"), errors[4]
    assert "is a staged recipe (stages:)" in errors[5] and "its base, configs/tiny.yaml" in \
        errors[5], errors[5]
    assert "is an RL run config (rl:)" in errors[6], errors[6]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_expert_parallel_ragged_all_to_all_lowers_for_the_accelerators(platform):
    """The `ragged` collective (what `ep_collective=auto` picks off CPU) lowers for TPU and CUDA
    under an abstract 8-device mesh (data=2, expert=4): no devices needed. XLA:CPU cannot run it,
    so lowering is as far as this machine goes."""
    mesh = abstract_mesh({"data": 2, "expert": 4})
    rows = NamedSharding(mesh, P(("data", "expert")))
    experts = NamedSharding(mesh, P("expert"))
    x = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=rows)
    indices = jax.ShapeDtypeStruct((64, 2), jnp.int32, sharding=rows)
    combine = jax.ShapeDtypeStruct((64, 2), jnp.float32, sharding=rows)
    weights = ExpertWeights(*(jax.ShapeDtypeStruct(s, jnp.float32, sharding=experts)
                              for s in ((8, 16, 32), (8, 16, 32), (8, 32, 16))))

    def dispatch(x, indices, combine, weights):
        return expert_parallel_experts(x, indices, combine, weights, clamp=SwiGLUClamp(0.0),
                                       impl="sorted", block_size=8, collective="auto")

    with lowering_for(platform), abstract_mesh_context(mesh):
        text = jax.jit(dispatch).trace(x, indices, combine, weights).lower(
            lowering_platforms=(platform,)).as_text()
    assert collectives(text).get("ragged_all_to_all", 0) >= 3  # rows, expert ids, results
