"""`make gpu-check` (benchmarks.gpu_suite) on CPU: its dry run writes both report files with
every section, and its correctness checks really compare: two deliberately wrong
implementations, added to the implementation tables, are caught where their bug shows and
only there, while every real implementation passes.

The dry run runs in a subprocess (the XLA flags of the tests' subprocesses, which compile
about 3x faster, and a compilation cache per version of the code; the wrong implementations are
added to the tables there before the suite starts).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from train_helpers import REPO, SUBPROCESS_XLA_FLAGS

from benchmarks import gpu_suite
from benchmarks.gpu_checks import kernel_note, unsupported
from benchmarks.gpu_plans import ACCELERATOR
from model.ops.attention_cores import xla_attention
from model.ops.moe_dispatch import sorted_block_ffn
from model.ops.swiglu import SwiGLUClamp

# One worker runs the whole module, so the dry run (a module fixture) runs once.
pytestmark = pytest.mark.xdist_group("gpu_suite")
SECTIONS = ["checks", "legs", "train", "profile", "remat", "moe", "attention", "decode"]
ATTENTION_ARRAYS = {"out", "dq", "dk", "dv"}
MOE_ARRAYS = {"out", "dx", "dgate", "dup", "ddown"}


def attention_ignoring_window(q, k, v, *, window, segment_ids, sink):
    """Wrong on purpose: full causal attention whatever the window."""
    del window
    return xla_attention(q, k, v, window=None, segment_ids=segment_ids, sink=sink)


def moe_ignoring_clamp(x, indices, weights, clamp, block_size):
    """Wrong on purpose: the SwiGLU clamp (report 4.1.3) left out."""
    del clamp
    return sorted_block_ffn(x, indices, weights, SwiGLUClamp(0.0), block_size)


RUN_WITH_WRONG_IMPLEMENTATIONS = """
import sys
from model.ops.tables import ATTENTION, MOE
ATTENTION.entries["window_ignored"] = "test_gpu_suite:attention_ignoring_window"
MOE.entries["clamp_ignored"] = "test_gpu_suite:moe_ignoring_clamp"
from benchmarks.gpu_suite import main
sys.exit(main(sys.argv[1:]))
"""


def source_digest() -> str:
    """A digest of the packages' and benchmarks' sources."""
    digest = hashlib.sha256()
    for path in sorted(p for d in ("model", "train", "pallas_kernels", "benchmarks")
                       for p in (REPO / d).rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    # A compilation cache of its own per version of the code: JAX keys cached programs without
    # their metadata, and the profile section reads the op paths (named scopes) from it.
    cache = Path(jax.config.jax_compilation_cache_dir) / "gpu_suite" / source_digest()
    env = {**os.environ, "XLA_FLAGS": SUBPROCESS_XLA_FLAGS, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
    result = subprocess.run([sys.executable, "-c", RUN_WITH_WRONG_IMPLEMENTATIONS, "--dry-run",
                             "--out", str(out)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=600)
    assert (out / "gpu_report.json").exists(), result.stdout + result.stderr
    return result, json.loads((out / "gpu_report.json").read_text()), \
        (out / "gpu_report.md").read_text()


def checks_by(report, table):
    return {(r["impl"], r["case"]): r for r in report["sections"]["checks"]["records"]
            if r["table"] == table}


@pytest.mark.slow
def test_dry_run_reports_every_section_and_fails_on_the_wrong_implementations(dry_run):
    result, report, markdown = dry_run
    assert result.returncode == 1, result.stderr  # the checks failed, as they must
    assert report["plan"] == "dry run" and report["exit_status"] == 1
    assert report["device"]["backend"] == "cpu" and report["device"]["peak_bf16_tflops"] is None
    assert report["versions"]["jax"]
    assert list(report["sections"]) == SECTIONS
    statuses = {name: s["status"] for name, s in report["sections"].items()}
    assert statuses == {name: "failed" if name == "checks" else "done" for name in SECTIONS}
    for title in ("## Targets", "## Correctness", "## Grouped matmuls per leg", "## Train step",
                  "## Where the train step's time goes", "## Remat policies", "## Attention",
                  "## MoE", "## Decoding"):
        assert title in markdown
    assert "Row(device='cpu'" in markdown  # the chosen rows, printed for the committed table
    assert all(t["met"] is None for t in report["targets"])  # a dry run meets no target


@pytest.mark.slow
def test_real_implementations_pass_after_comparing_outputs_and_gradients(dry_run):
    _, report, _ = dry_run
    attention, moe = checks_by(report, "attention"), checks_by(report, "moe")
    for impl in ("xla", "cudnn", "pallas"):
        for case, arrays in (("tiny swa", ATTENTION_ARRAYS | {"dsink"}),
                             ("tiny full", ATTENTION_ARRAYS)):
            record = attention[(impl, case)]
            assert record["status"] == "pass", record
            assert set(record["errors"]) == arrays
            assert all(np.isfinite(e) and e < record["tolerance"]
                       for e in record["errors"].values())
            assert record["compared"] > 0
    assert attention[("pallas", "tiny swa")]["note"] == "Pallas interpret mode"
    assert "XLA fallback" in attention[("cudnn", "tiny swa")]["note"]
    for impl in ("sorted", "ragged_dot", "pallas"):
        record = moe[(impl, "tiny")]
        assert record["status"] == "pass" and set(record["errors"]) == MOE_ARRAYS, record
    (ep,) = checks_by(report, "expert_parallel").values()
    assert ep["status"] == "skipped" and "one device" in ep["note"]


@pytest.mark.slow
def test_wrong_implementations_are_caught_where_their_bug_shows(dry_run):
    _, report, _ = dry_run
    attention, moe = checks_by(report, "attention"), checks_by(report, "moe")
    swa = attention[("window_ignored", "tiny swa")]
    assert swa["status"] == "fail" and swa["errors"]["out"] > 10 * swa["tolerance"]
    # Ignoring the window changes nothing where there is none.
    assert attention[("window_ignored", "tiny full")]["status"] == "pass"
    clamp = moe[("clamp_ignored", "tiny")]
    assert clamp["status"] == "fail" and clamp["errors"]["out"] > 10 * clamp["tolerance"]
    failed = {(r["impl"], r["case"]) for r in report["sections"]["checks"]["records"]
              if r["status"] != "pass" and r["table"] != "expert_parallel"}
    assert failed == {("window_ignored", "tiny swa"), ("clamp_ignored", "tiny")}


@pytest.mark.slow
def test_timings_train_and_decode_record_figures_or_reasons(dry_run):
    _, report, _ = dry_run
    sections = report["sections"]
    attention = {(r["impl"], r["kind"]): r for r in sections["attention"]["records"]}
    for kind in ("swa", "full"):
        assert attention[("xla", kind)]["status"] == "done"
        assert attention[("xla", kind)]["fwd_bwd_ms"] > 0
        assert "interpret mode" in attention[("pallas", kind)]["note"]
        assert "no cuDNN on CPU" in attention[("cudnn", kind)]["note"]
    moe = {r["impl"]: r for r in sections["moe"]["records"]}
    assert {moe[i]["status"] for i in ("dense FFN", "ragged_dot", "sorted")} == {"done"}
    assert moe["dense FFN"]["vs_dense"] == 1.0 and moe["pallas"]["status"] == "skipped"
    train = sections["train"]
    assert train["tokens_per_s"] > 0 and train["timed_steps"] == 2
    assert train["mfu"] is None  # no bf16 peak for a CPU
    assert train["step_scratch_gib"] > 0 and train["planner_total_gib"] > 0
    assert np.isfinite(train["loss_first"]) and np.isfinite(train["loss_last"])
    decode = sections["decode"]["records"]
    assert [r["draft"] for r in decode] == [0, 1]
    assert all(r["tokens_per_s"] > 0 and 0 <= r["chain_accuracy"] <= 1 for r in decode)


@pytest.mark.slow
def test_kernel_sweep_profile_and_remat_sections(dry_run):
    """The per-leg sweep checks and times what runs here and skips the rest with a reason; the
    profile attributes a real trace of two tiny steps; remat compares two policies."""
    _, report, _ = dry_run
    legs = report["sections"]["legs"]
    by = {(r["matmul"], r["leg"], r["backend"]): r for r in legs["records"]}
    assert len(legs["records"]) == 10  # 2 matmuls x (3 fwd + 1 dx + 1 dw candidates)
    for matmul, k_n in (("gate_up", (32, 32)), ("down", (16, 32))):
        assert "Hopper" in by[(matmul, "fwd", "mosaic_gpu")]["note"]
        triton = by[(matmul, "fwd", "triton")]
        assert triton["status"] == "done" and "interpret mode" in triton["note"]
        for leg in ("fwd", "dx", "dw"):
            xla = by[(matmul, leg, "xla")]
            assert xla["status"] == "done" and xla["error"] < 1e-2 and xla["tflops"] > 0
        assert (by[(matmul, "fwd", "xla")]["k"], by[(matmul, "fwd", "xla")]["n"]) == k_n
        assert (by[(matmul, "dx", "xla")]["k"], by[(matmul, "dx", "xla")]["n"]) == k_n[::-1]
    assert {(r["leg"], r["k"], r["n"]) for r in legs["chosen"]} == {
        ("fwd", 32, 32), ("dx", 32, 32), ("dw", 32, 32), ("fwd", 16, 32), ("dx", 32, 16),
        ("dw", 16, 32)}
    profile = report["sections"]["profile"]
    assert "note" not in profile, profile["note"]
    shares = {r["category"]: r["share"] for r in profile["records"]}
    assert profile["steps"] == 2 and profile["events"] > 0 and abs(sum(shares.values()) - 1) < 1e-9
    for category in ("attention", "expert matmuls", "dispatch", "router", "dense matmuls",
                     "norms and elementwise", "optimizer"):
        assert shares[category] > 0, category
    # ops without a JAX path are XLA's own (copies, loop control): a small part here
    assert profile["unnamed_ms_per_step"] < 0.25 * profile["op_ms_per_step"]
    remat = report["sections"]["remat"]["records"]
    assert [r["remat_policy"] for r in remat] == ["none", "dots_with_kernels"]
    assert all(r["step_s_median"] > 0 for r in remat)


def test_bad_arguments_get_one_line_errors(capsys):
    for argv, message in ((["--limit", "bogus=3"], "--limit: expected SECTION=SECONDS"),
                          (["--limit", "train=soon"], "'soon' is not a number"),
                          (["--train-override", "model.no_such_field=1"], "no_such_field")):
        with pytest.raises(SystemExit) as exit_info:
            gpu_suite.main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_pallas_is_checked_and_timed_on_gpu_and_tpu():
    """Both kernel families have an accelerator: only CPU (interpret mode) keeps `pallas` MoE out
    of the timings, and the checks run it everywhere; the flash-attention kernel is GPU only."""
    for backend in ("gpu", "tpu", "cpu"):
        assert unsupported("moe", "pallas", backend) is None
    assert unsupported("attention", "pallas", "tpu") is not None
    hlo = 'custom_call_target="mosaic_gpu_v2" custom_call_target="__gpu$xla.gpu.triton"'
    assert kernel_note("pallas", "gpu", hlo) == "Pallas kernels: Mosaic GPU, Triton"
    assert "odd dims" in {case.label for case in ACCELERATOR.moe_checks}


def test_train_section_falls_back_one_kernel_switch_at_a_time(monkeypatch):
    """A failing Pallas MoE leaves Pallas attention in place: the next attempt changes only the
    MoE to `ragged_dot`, and the failed attempt is reported with both switches."""
    from benchmarks import gpu_train

    tried = []

    def measure(run, **_):
        pair = (run.model.attention_impl, run.model.moe_impl)
        tried.append(pair)
        if pair[1] == "pallas":
            raise RuntimeError("Triton compilation failed")
        return ({"status": "done", "attention_impl": pair[0], "moe_impl": pair[1]},
                gpu_train.Trained(run, "state", "data", "step"))

    monkeypatch.setattr(gpu_train, "measure_training", measure)
    record, trained = gpu_train.train_section(
        "configs/gpu_1b.yaml", ["model.moe_impl=pallas"], warmup=1, steps=1, peak_tflops=None)
    assert tried == [("pallas", "pallas"), ("pallas", "ragged_dot")]
    assert (record["attention_impl"], record["moe_impl"]) == ("pallas", "ragged_dot")
    assert record["failed"] == [{"attention_impl": "pallas", "moe_impl": "pallas",
                                 "error": "RuntimeError: Triton compilation failed"}]
    assert trained[1:] == ("state", "data", "step")
    assert gpu_train.kernel_attempts("xla", "sorted") == [("xla", "sorted"), ("xla", "ragged_dot")]
