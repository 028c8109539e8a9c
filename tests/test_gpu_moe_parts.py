"""The MoE parts of `make gpu-check` on hand-written inputs: the profile section's attribution
(benchmarks/profiling.py: HLO instructions to JAX paths, paths to categories, nested trace
events to self times), the per-leg targets, the kernels the MoE checks name, the grouped-matmul
probe and the remat section (with a stubbed step). The dry run of tests/test_gpu_suite.py
attributes a real trace of two tiny train steps."""

import pytest

from benchmarks.gpu import profiling
from benchmarks.gpu.checks import moe_kernels
from benchmarks.gpu.plans import ACCELERATOR
from benchmarks.gpu.report import targets
from train.config import load_run_config

STEP = "jit(step_fn)/while/body/closed_call"
LAYER = f"{STEP}/transpose(jvp(CausalLM))/CausalLM.backbone/layers/segment_1/block_0"


def test_paths_fall_into_their_categories():
    cases = {
        f"{STEP}/optimizer/dot_general": "optimizer",  # Polar Express matmuls are optimizer time
        f"{LAYER}/moe/router/dot_general": "router",
        f"{LAYER}/moe/experts/dispatch/gather": "dispatch",
        f"{LAYER}/moe/dispatch/dot_general": "dispatch",  # the combine
        f"{LAYER}/moe/experts/pallas_call": "expert matmuls",
        f"{LAYER}/moe/experts/mpmd_map": "expert matmuls",  # a Mosaic GPU kernel
        f"{LAYER}/moe/experts/logistic": "norms and elementwise",  # the SwiGLU
        f"{LAYER}/moe/experts/monitors/reduce_sum": "norms and elementwise",
        f"{LAYER}/moe/experts/monitors/scatter-add": "other",
        f"{LAYER}/self_attn/pallas_call": "attention",
        f"{LAYER}/self_attn/mul": "attention",  # RoPE, the gate
        f"{LAYER}/self_attn/q_proj/dot_general": "dense matmuls",
        f"{LAYER}/self_attn/q_norm/rsqrt": "norms and elementwise",
        f"{LAYER}/moe/shared_expert/dot_general": "dense matmuls",
        f"{LAYER}/input_layernorm/reduce_sum": "norms and elementwise",
        f"{STEP}/jvp(CausalLM)/embed_tokens/jit(_take)/gather": "other",
        f"{STEP}/while": "other",
    }
    for path, want in cases.items():
        assert profiling.category(path) == want, path


def test_instruction_names_come_from_the_module_text():
    hlo = """HloModule jit_step_fn, entry_computation_layout={...}

%fused_computation.3 (param_0: f32[8]) -> f32[8] {
  ROOT %tanh.1 = f32[8]{0} tanh(f32[8]{0} %param_0), metadata={op_name="jit(step_fn)/tanh"}
}

ENTRY %main.9 (p: bf16[4,8]) -> bf16[4,8] {
  %custom-call.2 = bf16[4,8]{1,0} custom-call(%p), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step_fn)/moe/experts/pallas_call" source_file="x.py"}
  ROOT %fusion.7 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_computation.3, metadata={op_name="jit(step_fn)/mul"}
}
"""
    assert profiling.module_name(hlo) == "jit_step_fn"
    assert profiling.op_names(hlo) == {"tanh.1": "jit(step_fn)/tanh",
                                         "custom-call.2": "jit(step_fn)/moe/experts/pallas_call",
                                         "fusion.7": "jit(step_fn)/mul"}
    seconds, unnamed = profiling.attribute(
        [("custom-call.2", 3_000_000), ("fusion.7", 1_000_000), ("copy.4", 500_000)],
        profiling.op_names(hlo))
    assert seconds["expert matmuls"] == 3e-3 and seconds["norms and elementwise"] == 1e-3
    assert seconds["other"] == 5e-4 and unnamed == 5e-4
    assert list(seconds) == list(profiling.CATEGORIES)


def test_nested_events_count_their_self_time():
    # a loop [0, 100) holding two ops [10, 30) and [40, 90), the second holding [50, 60)
    events = [(0, 100, "while"), (10, 20, "a"), (40, 50, "b"), (50, 10, "c"), (200, 5, "d")]
    assert sorted(profiling._self_times(events)) == [
        ("a", 20), ("b", 40), ("c", 10), ("d", 5), ("while", 30)]


def test_chosen_legs_become_targets_against_half_the_peak():
    row = {"device": "NVIDIA H100 80GB HBM3", "jax": "0.11", "dtype": "bfloat16", "leg": "dw",
           "k": 1536, "n": 1024, "backend": "triton", "config": [128, 64, 128], "tflops": 520.0,
           "source": "test"}
    sections = {"legs": {"peak_tflops": 989.0, "chosen": [row, {**row, "tflops": 400.0}]}}
    rows = [t for t in targets(sections, device_run=True) if "grouped matmul" in t["target"]]
    assert [t["met"] for t in rows] == [True, False]
    assert rows[0]["target"] == "grouped matmul dw 1536x1024 TFLOP/s (chosen: triton)"


def test_moe_checks_name_the_grouped_matmul_kernels_of_each_leg(monkeypatch):
    from pallas_kernels import grouped_leg_table as table

    monkeypatch.setattr(table, "current_device",
                        lambda: table.Device("gpu", "NVIDIA H100 80GB HBM3", True, "0.11"))
    case = ACCELERATOR.moe_checks[-1]
    assert (case.label, case.dtype) == ("medium", "bfloat16")
    assert moe_kernels(case, "gpu") == "fwd mosaic_gpu; dx mosaic_gpu; dw triton"
    assert moe_kernels(case._replace(dtype="float32"), "gpu") == "fwd triton; dx triton; dw triton"
    assert moe_kernels(case, "cpu") == "Pallas interpret mode"


def test_grouped_probe_takes_out_the_legs_that_failed(monkeypatch):
    from benchmarks.gpu import moe_probe
    from pallas_kernels import grouped_leg_table as table

    monkeypatch.setattr(table, "UNAVAILABLE", {})
    stdout = "\n".join(['noise', 'PROBE {"fwd": {"error": 0.004}}',
                        'PROBE {"dx": {"error": 0.9}}',
                        'PROBE {"dw": {"exception": "ValueError: bad"}}'])
    assert moe_probe.verdicts(stdout) == {
        "fwd": None, "dx": "relative error 9.00e-01 over 0.05", "dw": "ValueError: bad"}
    assert moe_probe.verdicts("")["fwd"] == "did not finish"

    class Child:  # a child that printed the lines above and exited
        returncode = 0

        def communicate(self, timeout=None):
            return stdout, ""

    assert moe_probe.finish(Child()).startswith("fwd ok; dx relative error")
    assert set(table.UNAVAILABLE) == {("mosaic_gpu", "dx"), ("mosaic_gpu", "dw")}
    h100 = table.Device("gpu", "NVIDIA H100 80GB HBM3", True, "0.11")
    assert [table.rule(leg, "bfloat16", h100).backend for leg in ("fwd", "dx", "dw")] == \
        ["mosaic_gpu", "triton", "triton"]


def test_remat_section_times_the_step_again_under_the_other_policy(monkeypatch):
    from benchmarks.gpu import training

    run = load_run_config("configs/gpu_1b.yaml")
    policies = []

    def measure(run, **_):
        policies.append(run.model.remat_policy)
        return {"remat_policy": run.model.remat_policy, "step_s_median": 0.4, "mfu": 0.3}, None

    monkeypatch.setattr(training, "measure_training", measure)
    trained = training.Trained(run, "state", "data", "step")
    baseline = {"status": "done", "remat_policy": "dots", "step_s_median": 0.5, "mfu": 0.24}
    section = training.remat_section(trained, baseline, "dots_with_kernels", warmup=1, steps=2,
                                      peak_tflops=989.0)
    assert policies == ["dots_with_kernels"] and section["speedup"] == pytest.approx(1.25)
    assert [r["remat_policy"] for r in section["records"]] == ["dots", "dots_with_kernels"]
    assert "| dots_with_kernels | 0.4 |" in "\n".join(training.remat_markdown(section))
    assert training.remat_section(None, baseline, "dots", warmup=1, steps=1,
                                   peak_tflops=None)["status"] == "skipped"
