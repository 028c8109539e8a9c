"""`python -m benchmarks.lowering`: the train and decode steps of the three tiny presets lower for
TPU on this CPU machine with the Pallas kernels (splash attention and the Mosaic grouped
matmuls), nothing compiled. One subprocess lowers all three (one JAX start-up; the kernel choices
follow the platform while tracing, which JAX's jit cache does not key on, so the lowering runs
apart from this test process) at 2 x 128 tokens."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.lowering import kernel_calls, main

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
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and all(e.startswith("error: ") for e in errors), errors
