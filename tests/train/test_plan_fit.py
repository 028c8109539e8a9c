"""`python -m train.plan --fit` and the step-time model it ranks layouts by."""

from __future__ import annotations

import json

import pytest

from model.parallel.rules import MESH_AXES
from train.config import load_run_config
from train.parallel.memory_plan import device_rows, plan_memory, state_bytes
from train.parallel.plan import main
from train.parallel.step_time import Hardware, link_gbps, step_time
from train_helpers import PIPELINABLE, TINY

HW = Hardware(peak_tflops=100.0, mfu=0.5, intra_node_gbps=400.0, inter_node_gbps=50.0,
              node_size=8)


def timed(*overrides, sizes):
    run = load_run_config(TINY, [*overrides, *(f"mesh.{a}={n}" for a, n in sizes.items())])
    full = {a: sizes.get(a, 1) for a in MESH_AXES}
    rows = device_rows(run, full, state_bytes(run, full))
    return step_time(run, full, rows, HW), rows


def test_links_are_the_node_for_inner_axes_and_the_network_beyond():
    sizes = {"pipeline": 2, "data": 16, "fsdp": 1, "expert": 4, "tensor": 2}
    assert link_gbps(sizes, "tensor", HW) == link_gbps(sizes, "expert", HW) == 400.0
    assert link_gbps(sizes, "fsdp", HW) == 400.0  # size 1: still inside the 8 of expert x tensor
    assert link_gbps(sizes, "data", HW) == link_gbps(sizes, "pipeline", HW) == 50.0


def test_step_time_terms():
    one, rows = timed("train.seq_len=128", sizes={"data": 1})
    two, _ = timed("train.seq_len=128", sizes={"data": 2})
    # Twice the devices on data: half the compute each, and a gradient all-reduce of the
    # (unsharded) gradients: 2 (w-1)/w of the param bytes over the node's link.
    assert two["compute"] == pytest.approx(one["compute"] / 2)
    params = rows["per_device"]["params"]
    assert two["communication"]["data"] == pytest.approx(params / (400.0 * 1e9))
    assert one["communication"]["data"] == 0.0 and one["bubble"] == 0.0
    # remat `full` recomputes the layers' forward: more compute than `none`, `dots` in between
    compute = {p: timed("train.seq_len=128", f"model.remat_policy={p}", sizes={"data": 1})[0]
               ["compute"] for p in ("none", "dots", "full")}
    assert compute["none"] < compute["dots"] < compute["full"] < 4 / 3 * compute["none"]
    # 8 identical layers in one segment over 2 stages, 4 micro-batches: bubble 1/5, and each
    # device runs half the layers' work (the embeddings and heads split their rows over the
    # stages too); pipeline_stage_remat (default) reruns each tick's forward in the backward:
    # half the layers' forward, what `full` remat adds to a device holding them all
    eight = ("train.seq_len=128", *PIPELINABLE)
    piped, _ = timed(*eight, sizes={"pipeline": 2})
    unremat, _ = timed(*eight, "model.pipeline_stage_remat=false", sizes={"pipeline": 2})
    whole, _ = timed(*eight, sizes={"data": 1})
    full, _ = timed(*eight, "model.remat_policy=full", sizes={"data": 1})
    assert piped["bubble"] == pytest.approx(1 / 5)
    assert unremat["compute"] == pytest.approx(whole["compute"] / 2)
    assert piped["compute"] - unremat["compute"] == pytest.approx(
        (full["compute"] - whole["compute"]) / 2)
    assert piped["seconds"] == pytest.approx(piped["compute"] / (1 - 1 / 5)
                                             + piped["exposed_communication"])



def test_data_traffic_is_the_whole_gradient_when_master_weights_shard_over_data():
    # bfloat16 compute: the float32 master weights shard over data=2, so a device stores half
    # of them, but the reduce-scatter and the copy's gather move the whole gradient: 2 (w-1)/w
    # of twice the device's params row
    two, rows = timed("train.seq_len=128", "model.compute_dtype=bfloat16", sizes={"data": 2})
    assert two["communication"]["data"] == pytest.approx(
        2 * rows["per_device"]["params"] / (400.0 * 1e9))


def test_fit_lists_fitting_layouts_fastest_first(capsys):
    argv = ["--config", str(TINY), "--fit", "--devices", "8", "--batch-size", "16",
            "--seq-len", "256", "--device-memory", "0.5", "--top", "50", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    layouts = result["layouts"]
    assert layouts and result["fitting_layouts"] >= len(layouts)
    times = [x["step_seconds"] for x in layouts]
    assert times == sorted(times)
    assert {x["remat_policy"] for x in layouts} >= {"none", "full"}
    assert any(x["mesh"]["pipeline"] > 1 for x in layouts)
    # Each layout's memory is the plan of its own overrides, within the budget.
    for layout in (layouts[0], layouts[-1]):
        run = load_run_config(TINY, ["train.batch_size=16", "train.seq_len=256",
                                     *layout["overrides"]])
        plan = plan_memory(run, layout["mesh"], 0.5)
        assert plan["per_device_bytes"]["total"] == layout["memory_bytes"] <= 0.5 * 2**30
        assert plan["accumulation_steps"] == layout["accumulation_steps"]
    assert main([*argv[:-1]]) == 0
    assert "the fastest: mesh.pipeline=" in capsys.readouterr().out


def test_fit_when_nothing_fits_and_bad_flags(capsys):
    assert main(["--config", str(TINY), "--fit", "--devices", "2",
                 "--device-memory", "0.001"]) == 1
    captured = capsys.readouterr()
    assert "no layout fits 0.001 GiB per device" in captured.out
    assert captured.err.startswith("WARNING: ") and "no layout fits" in captured.err
    # a batch that no mesh of 8 devices splits (7 sequences) is named as such
    assert main(["--config", str(TINY), "--fit", "--devices", "8", "--batch-size", "7"]) == 1
    assert "no layout splits the batch of 7 sequences over 8" in capsys.readouterr().err
    for argv, needle in ((["--devices", "8", "--mesh", "data=8"], "--mesh"),
                         ([], "--devices"), (["--devices", "8", "--mfu", "1.5"], "--mfu"),
                         (["--devices", "8", "--node-size", "0"], "--node-size")):
        assert main(["--config", str(TINY), "--fit", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and needle in err


@pytest.mark.slow
@pytest.mark.parametrize("config, devices, batch", [
    ("step35_flash", 4096, 4096),  # the report's scale: 4,096 GPUs, 4,096 x 4,096 tokens
    ("deepseek_v4_flash", 2048, 2048), ("mimo_v2_flash", 2048, 2048)])
def test_fit_answers_for_every_full_size_family(capsys, config, devices, batch):
    """Each family's full-size preset on cards of 80 GiB: fitting layouts, fastest first, each
    one's memory the plan of its own overrides."""
    path = str(TINY.parent / f"{config}.yaml")
    assert main(["--config", path, "--fit", "--devices", str(devices), "--batch-size",
                 str(batch), "--seq-len", "4096", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["meshes_planned"] > 10 and result["layouts_planned"] > 100
    layouts = result["layouts"]
    assert layouts and [x["step_seconds"] for x in layouts] == sorted(
        x["step_seconds"] for x in layouts)
    assert all(x["memory_bytes"] <= 80 * 2**30 for x in layouts)
    best = layouts[0]
    run = load_run_config(path, [f"train.batch_size={batch}", "train.seq_len=4096",
                                 *best["overrides"]])
    assert plan_memory(run, best["mesh"])["per_device_bytes"]["total"] == best["memory_bytes"]
