"""`make gpu-check` (benchmarks.gpu.suite) on CPU: its dry run writes both report files with
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
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import REPO, SUBPROCESS_XLA_FLAGS

from benchmarks.gpu import attention_sweep as sweep
from benchmarks.gpu import decode, suite
from benchmarks.gpu import mosaic_probe
from benchmarks.gpu.attention_checks import cudnn_verdict, pallas_verdict
from benchmarks.gpu.attention_targets import attention_targets
from benchmarks.gpu.checks import kernel_note, unsupported
from benchmarks.gpu.plans import ACCELERATOR
from benchmarks.gpu.v4_layers import v4_targets
from model.inference.decode import Generation
from model.ops.attention_cores import xla_attention
from model.ops.moe_dispatch import sorted_block_ffn
from model.ops.swiglu import SwiGLUClamp
from pallas_kernels import mgpu_attention_common as mgpu_common
from pallas_kernels.attention import UNAVAILABLE, kernel_family
from pallas_kernels.flash_attention_blocks import load_table

# One worker runs the whole module, so the dry run (a module fixture) runs once.
pytestmark = pytest.mark.xdist_group("gpu_suite")
SECTIONS = ["checks", "legs", "train", "moe", "profile", "attention", "remat", "decode",
            "attention_sweep", "v4_layers"]
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
from benchmarks.gpu.suite import main
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
    skipped = {"attention_sweep", "remat"}  # needs sm90; the dry run's policy is the train's
    assert statuses == {name: "failed" if name == "checks" else
                        "skipped" if name in skipped else "done" for name in SECTIONS}
    assert "sm90" in report["sections"]["attention_sweep"]["note"]
    for title in ("## Targets", "## Correctness", "## Grouped matmuls per leg", "## Train step",
                  "## Where the train step's time goes", "## Remat policies", "## Attention",
                  "## MoE", "## Decoding", "## Mosaic GPU flash-attention block sweep",
                  "## DeepSeek-V4 attention layers"):
        assert title in markdown
    table = json.loads(Path(report["sections"]["legs"]["table"]).read_text())
    assert table["status"].startswith("measured on cpu") and len(table["rows"]) == 6
    assert all(t["met"] is None for t in report["targets"])  # a dry run meets no target


@pytest.mark.slow
def test_real_implementations_pass_after_comparing_outputs_and_gradients(dry_run):
    _, report, _ = dry_run
    attention, moe = checks_by(report, "attention"), checks_by(report, "moe")
    for impl in ("xla", "cudnn", "pallas"):
        for case, arrays in (("tiny swa", ATTENTION_ARRAYS | {"dsink"}),
                             ("tiny full", ATTENTION_ARRAYS),
                             ("tiny mimo", ATTENTION_ARRAYS | {"dsink"})):  # Dv < D
            record = attention[(impl, case)]
            assert record["status"] == "pass", record
            assert set(record["errors"]) == arrays
            assert all(np.isfinite(e) and e < record["tolerance"]
                       for e in record["errors"].values())
            assert record["compared"] > 0
    assert attention[("pallas", "tiny swa")]["note"] == "Pallas interpret mode"
    assert attention[("cudnn", "tiny swa")]["note"] == \
        "XLA fallback of jax.nn.dot_product_attention (no cuDNN on cpu)"
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
    assert failed == {("window_ignored", "tiny swa"), ("window_ignored", "tiny mimo"),
                      ("clamp_ignored", "tiny")}


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
    assert [(r["config"], r["batch"], r["draft"]) for r in decode] == [
        ("gpu_1b (trained)", 1, 0), ("gpu_1b (trained)", 1, 1)]
    assert all(r["tokens_per_s"] > 0 and 0 <= r["chain_accuracy"] <= 1 for r in decode)
    (v4,) = sections["v4_layers"]["records"]
    assert (v4["kind"], v4["status"]) == ("W", "done") and v4["fwd_bwd_ms"] > 0


@pytest.mark.slow
def test_kernel_sweep_profile_and_remat_sections(dry_run):
    """The per-leg sweep checks and times what runs here and skips the rest with a reason; the
    profile attributes a real trace of two tiny steps; remat skips comparing a policy with
    itself."""
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
    assert report["sections"]["remat"]["note"] == "the train section ran remat_policy=none"


def test_bad_arguments_get_one_line_errors(capsys):
    for argv, message in ((["--limit", "bogus=3"], "--limit: expected SECTION=SECONDS"),
                          (["--limit", "train=soon"], "'soon' is not a number"),
                          (["--train-override", "model.no_such_field=1"], "no_such_field")):
        with pytest.raises(SystemExit) as exit_info:
            suite.main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_pallas_is_checked_and_timed_on_gpu_and_tpu():
    """Both kernel families have an accelerator: only CPU (interpret mode) keeps `pallas` MoE out
    of the timings, and the checks run it everywhere; the flash-attention kernel is GPU only."""
    for backend in ("gpu", "tpu", "cpu"):
        assert unsupported("moe", "pallas", backend) is None
    assert unsupported("attention", "pallas", "tpu") is not None
    assert kernel_note("pallas", "gpu", "") == "Pallas Triton kernels"
    assert "odd dims" in {case.label for case in ACCELERATOR.moe_checks}


def test_train_section_falls_back_one_kernel_switch_at_a_time(monkeypatch):
    """A failing Pallas MoE leaves Pallas attention in place: the next attempt changes only the
    MoE to `ragged_dot`, and the failed attempt is reported with both switches."""
    from benchmarks.gpu import training

    tried = []

    def measure(run, **_):
        pair = (run.model.attention_impl, run.model.moe_impl)
        tried.append(pair)
        if pair[1] == "pallas":
            raise RuntimeError("Triton compilation failed")
        return ({"status": "done", "attention_impl": pair[0], "moe_impl": pair[1]},
                training.Trained(run, "state", "data", "step"))

    monkeypatch.setattr(training, "measure_training", measure)
    record, trained = training.train_section(
        "configs/gpu_1b.yaml", ["model.moe_impl=pallas"], warmup=1, steps=1, peak_tflops=None)
    assert tried == [("pallas", "pallas"), ("pallas", "ragged_dot")]
    assert (record["attention_impl"], record["moe_impl"]) == ("pallas", "ragged_dot")
    assert record["failed"] == [{"attention_impl": "pallas", "moe_impl": "pallas",
                                 "error": "RuntimeError: Triton compilation failed"}]
    assert trained[1:] == ("state", "data", "step")
    assert training.kernel_attempts("xla", "sorted") == [("xla", "sorted"), ("xla", "ragged_dot")]


H100 = (9, 0)


def test_attention_checks_demand_cudnn_its_window_and_the_mosaic_kernels_from_the_hlo():
    """On a GPU the `cudnn` check fails unless the compiled HLO holds cuDNN's attention call
    (with its sliding window for SWA) wherever cuDNN can express the case, and names the
    reason where it cannot; `pallas` on sm90 must show the Mosaic GPU calls."""
    q = jax.ShapeDtypeStruct((1, 64, 4, 128), jnp.bfloat16)
    segments = jnp.zeros((1, 64), jnp.int32)
    call = 'custom_call_target="__cudnn$fmhaSoftmax", backend_config={"sliding_window_length":512}'
    assert cudnn_verdict("gpu", q, None, 512, call, H100) == (
        "cuDNN fused attention, sliding window 512", None)
    assert cudnn_verdict("gpu", q, None, None, "fusion", H100)[1] == \
        "the compiled HLO holds no cuDNN attention call"
    assert "no cuDNN sliding window of 128" in cudnn_verdict("gpu", q, None, 128, call, H100)[1]
    note, problem = cudnn_verdict("gpu", q, segments, 512, "fusion", H100)
    assert problem is None and note.startswith("xla core: segment ids")
    kv = jax.ShapeDtypeStruct((1, 64, 2, 128), jnp.bfloat16)
    assert pallas_verdict("gpu", q, kv, kv, "fusion", H100)[1] == \
        "no mosaic_gpu call in the compiled HLO"
    assert pallas_verdict("gpu", q, kv, kv, 'custom_call_target="mosaic_gpu_v2"', H100) == (
        "Mosaic GPU kernels (sm90)", None)
    assert pallas_verdict("gpu", q, kv, kv, "", (8, 0)) == ("Pallas Triton kernels", None)


def _attention_record(length, kind, impl, ms, of_peak=None, note=""):
    return {"length": length, "kind": kind, "impl": impl, "status": "done", "fwd_bwd_ms": ms,
            "of_peak": of_peak, "note": note}


def test_attention_and_v4_targets_come_from_the_section_records():
    records = [_attention_record(8192, "full", "pallas", 4.0, 0.30, "Mosaic GPU"),
               _attention_record(8192, "full", "cudnn", 3.6, 0.36),
               _attention_record(4096, "swa", "pallas", 1.0),
               _attention_record(32768, "swa", "pallas", 8.5)]
    peak, speed, growth = attention_targets({"attention": {"records": records}})
    assert (peak["value"], peak["met"]) == (0.36, True)
    assert speed["value"] == pytest.approx(0.9) and speed["met"] is True
    assert growth["value"] == pytest.approx(8.5) and growth["met"] is True
    triton = [{**r, "note": "Triton"} if r["impl"] == "pallas" else r for r in records]
    assert attention_targets({"attention": {"records": triton}})[1]["value"] is None
    v4 = [{"length": t, "kind": k, "status": "done", "fwd_bwd_ms": ms}
          for t, k, ms in ((16384, "C", 6.0), (16384, "dense", 10.0), (8192, "C", 3.0),
                           (65536, "C", 30.0))]
    ratio, csa_growth = v4_targets({"v4_layers": {"records": v4}})
    assert (ratio["value"], ratio["met"]) == (0.6, False)
    assert (csa_growth["value"], csa_growth["met"]) == (10.0, False)


def test_sweep_candidates_fit_and_the_chosen_table_records_the_device(tmp_path):
    assert len(sweep.CANDIDATES) <= sweep.MAX_CANDIDATES
    for candidate in sweep.CANDIDATES:
        for name, blocks in zip(("forward", "dq", "dkv"), candidate):
            blocks.check(name)
            rows, stream = blocks.block, blocks.stream
            own, streamed = {  # D = 128 with segment ids: the largest of each kernel
                "forward": ([(rows, 128), (rows, 128), (rows,), (rows,)],
                            [(stream, 128), (stream, 128), (stream,)]),
                "dq": ([(rows, 128), (rows, 128), (rows,), (rows,), (rows,)],
                       [(stream, 128), (stream, 128), (stream,)]),
                "dkv": ([(rows, 128), (rows, 128), (rows,)],
                        [(stream, 128), (stream, 128), (stream,), (stream,), (stream,)])}[name]
            mgpu_common.check_smem(name, mgpu_common.smem_bytes(own, streamed, blocks), blocks)
    assert sweep.skip_reason("gpu", (8, 0)) and sweep.skip_reason("cpu", None)
    assert sweep.skip_reason("gpu", H100) is None
    table = sweep.chosen_table(sweep.CANDIDATES[3], (128, 128), "NVIDIA H100 80GB HBM3")
    assert table["device"] == "NVIDIA H100 80GB HBM3" and table["status"].startswith("measured")
    assert table["entries"]["128x128"]["dq"] == [64, 128, 2, 2]
    assert table["entries"]["192x128"] == load_table()["entries"]["192x128"]


class FakeDecoder:
    """Stands in for model.inference.decode.Decoder: fixed rates, batch 2 runs out of memory."""

    def __init__(self, model, variables, *, max_len, draft, prefill_chunk):
        self.draft = draft

    def generate(self, rows, new_tokens, *, speculative):
        if len(rows) == 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        accepted = 1.5 if speculative else 1.0
        return Generation(tokens=[[5, 6, 7, 8][:new_tokens]] * len(rows), forward_passes=2,
                          mean_accepted=accepted, prefill_seconds=0.0, decode_seconds=1.0,
                          decode_tokens=int(100 * accepted) * len(rows))


def test_decode_records_rates_speedups_accuracy_and_failures(monkeypatch):
    monkeypatch.setattr(decode, "Decoder", FakeDecoder)
    prompts = np.zeros((2, 3), np.int32)
    truth = np.array([[5, 6, 0, 0], [5, 0, 0, 0]])
    records = decode._rates("m", None, None, prompts, 4, 1, truth, (1, 2),
                                deadline=float("inf"))
    by_case = {(r["batch"], r["draft"]): r for r in records}
    assert by_case[(1, 0)]["tokens_per_s"] == 100 and by_case[(1, 1)]["speedup"] == 1.5
    assert by_case[(1, 1)]["chain_accuracy"] == 0.5
    assert by_case[(2, 0)]["status"] == "error" and "out of memory" in by_case[(2, 0)]["note"]
    late = decode._rates("m", None, None, prompts, 4, 0, None, (1,), deadline=0.0)
    assert [r["status"] for r in late] == ["skipped"]
    section = decode.decode_section(None, (("bad", "configs/no_such.yaml", ()),),
                                        prompt_len=3, new_tokens=4, batches=(1,),
                                        deadline=float("inf"))
    assert [r["status"] for r in section["records"]] == ["skipped", "error"]


def test_mosaic_probe_reports_hangs_failures_and_wrong_numbers(monkeypatch):
    """The suite's first run of the Mosaic kernels (a child process): fine, wrong numbers,
    a crash and a hang each give their verdict (children stand in for the real one here)."""
    def verdict(child, timeout=30.0):
        monkeypatch.setattr(mosaic_probe, "CHILD", child)
        return mosaic_probe.probe_mosaic(timeout)

    fine = 'print("PROBE " + \'{"out": 0.001, "dq": 0.002}\')'
    assert verdict(fine) == (True, "probe worst error dq 2.00e-03")
    usable, note = verdict(fine.replace("0.002", "0.5"))
    assert not usable and "over the bfloat16 tolerance" in note
    usable, note = verdict("raise SystemExit('wgmma failed')")
    assert not usable and note == "the probe failed (exit 1): wgmma failed"
    usable, note = verdict("import time; time.sleep(30)", timeout=0.5)
    assert not usable and "did not finish" in note


def test_an_unusable_mosaic_family_leaves_pallas_on_triton(monkeypatch):
    q = jax.ShapeDtypeStruct((1, 128, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 128, 2, 128), jnp.bfloat16)
    assert kernel_family(q, kv, kv, H100) == "mosaic"
    monkeypatch.setitem(UNAVAILABLE, "mosaic", "the probe hung")
    assert kernel_family(q, kv, kv, H100) == "triton"
