"""Parallelism on 8 CPU devices (docs/architecture.md, "Measured on CPU"): a train step on several
meshes equals the same step on one device, params are laid out as the rules table says, and
expert-parallel dispatch drops nothing under skewed routing. The 8-device runs happen in a
subprocess (tests/parallel_worker.py) because the device count is fixed when JAX starts."""

import math
from pathlib import Path

import pytest
from jax.sharding import PartitionSpec as P
from train_helpers import TINY, run_device_worker

from model.parallel.rules import MESH_AXES, abstract_mesh, logical_to_spec
from train.config import MeshConfig, load_run_config
from train.parallel.sharding import zero1_spec

WORKER = Path(__file__).resolve().parents[1] / "parallel_worker.py"
TOLERANCE = 1e-5  # relative, float32 with a different reduction order

# Expected layouts, read off the rules table by hand: vocab/heads/mlp/expert_mlp -> tensor,
# embed -> fsdp, expert -> expert, the pipelined segment's layers -> pipeline. Shapes:
# embedding [64, 32], expert_gate [2, 8, 32, 16] and q_proj [2, 32, 4, 8] in the pipelined
# F x 2 segment, dense_up [1, 32, 64] in the leading dense layer's segment.
EXPECTED = {
    "data=8": {"embedding": [None, None], "expert_gate": [None, None, None, None],
               "q_proj": [None, None, None, None], "dense_up": [None, None, None]},
    "fsdp=4,expert=2": {"embedding": [None, "fsdp"], "expert_gate": [None, "expert", "fsdp", None],
                        "q_proj": [None, "fsdp", None, None], "dense_up": [None, "fsdp", None]},
    "data=2,expert=2,tensor=2": {
        "embedding": ["tensor", None], "expert_gate": [None, "expert", None, "tensor"],
        "q_proj": [None, None, "tensor", None], "dense_up": [None, None, "tensor"]},
    "pipeline=2,data=4": {
        "embedding": [None, None], "expert_gate": ["pipeline", None, None, None],
        "q_proj": ["pipeline", None, None, None], "dense_up": [None, None, None]},
    # 2 virtual stages on 2 repeats: 4 chunks (2 empty) that the step arranges from the stored
    # stack, so `pipeline` shards the largest other dimension it divides (with `fsdp` there)
    "pipeline=2,expert=2,fsdp=2,virtual=2": {
        "embedding": [None, "fsdp"],
        "expert_gate": [None, "expert", ["fsdp", "pipeline"], None],
        "q_proj": [None, ["fsdp", "pipeline"], None, None], "dense_up": [None, "fsdp", None]},
}


def run_worker(*args: str) -> dict:
    return run_device_worker(WORKER, 8, *args)


def sizes_of(mesh: str) -> dict[str, int]:
    """Mesh axis sizes, and `virtual` (model.pipeline_virtual_stages) when given."""
    return {k: int(v) for k, v in (item.split("=") for item in mesh.split(","))}


def axes_of(entry) -> list[str]:
    """Mesh axes of one spec entry: None, a name or a list of names."""
    return [] if entry is None else [entry] if isinstance(entry, str) else list(entry)


def check_mesh_result(mesh: str, result: dict, whole_step: bool) -> None:
    keys = ["loss_error", "balance_error", "grad_error"]
    if whole_step:  # the Muon update under sharding, and the pipeline's bubble metric
        keys += ["step_loss_error", "param_error"]
    for key in keys:
        assert result[key] < TOLERANCE, (mesh, key, result[key])
    sizes = sizes_of(mesh)
    for name, want in EXPECTED[mesh].items():
        layout = result["layouts"][name]
        got = layout["spec"] + [None] * (len(layout["shape"]) - len(layout["spec"]))
        assert got == want, (mesh, name, got)
        local = [dim // math.prod(sizes[a] for a in axes_of(axis))
                 for dim, axis in zip(layout["shape"], want)]
        assert layout["local_shape"] == local, (mesh, name)
    momentum_axes = {a for e in result["momentum_spec"] for a in axes_of(e)}
    assert {a for e in EXPECTED[mesh]["expert_gate"] for a in axes_of(e)} <= momentum_axes
    assert ("data" in momentum_axes) == (sizes.get("data", 1) > 1)  # ZeRO-1
    if whole_step:
        stages, virtual = sizes.get("pipeline", 1), sizes.get("virtual", 1)
        microbatches = 2 * stages
        assert result["bubble"] == pytest.approx(
            (stages - 1) / (virtual * microbatches + stages - 1) if stages > 1 else 0.0)


# The whole step (with the Muon update) runs on the meshes that exercise ZeRO-1 + expert +
# tensor and interleaved pipeline stages + expert + fsdp; loss and gradients are compared on all
# five (GPipe on pipeline=2,data=4). One worker
# process, so the one-device reference compiles once (tracing and compiling dominate: ~10 s a
# program).
MESHES = ("data=8", "fsdp=4,expert=2", "step:data=2,expert=2,tensor=2", "pipeline=2,data=4",
          "step:pipeline=2,expert=2,fsdp=2,virtual=2")


@pytest.mark.slow
def test_deepseek_v4_model_on_a_mesh_matches_one_device():
    """W/C/H attention, mHC streams and hash routing under pipeline, fsdp and expert sharding:
    the two hash-routed W layers are the pipelined segment, so every stage carries the 2 mHC
    streams and the token ids its hash routing reads."""
    results = run_worker("v4:pipeline=2,fsdp=2,expert=2")
    for mesh, result in results.items():
        assert result["loss_error"] < TOLERANCE, (mesh, result)
        # mHC's head biases and gates get sums over every token of largely cancelling terms; the
        # MTP block's head bias gradient is 1e-7 in norm, and pure data parallelism (data=8)
        # already moves it by 1.2e-3 relative (float32, another order of the batch reduction);
        # a sharding error is O(1).
        assert result["grad_error"] < 5e-3, (mesh, result)


@pytest.mark.slow
def test_mimo_model_on_a_mesh_matches_one_device():
    """Per-type KV heads (1 full / 2 SWA: the full layers' single KV head cannot split over
    tensor=2, the rules leave it whole), values narrower than keys, sinks on the SWA layers and
    the MTP block, no shared expert; the 4 SWA layers' scanned segment in two pipeline stages
    with two virtual stages each (the interleaved schedule: 4 chunks of one layer, each
    micro-batch passing both devices twice), experts and heads sharded. One mesh per worker: a
    second mesh in the same process (fsdp=2,expert=2,tensor=2 then pipeline=2,expert=2,fsdp=2,
    each passing alone) hit XLA:CPU's 40 s collective rendezvous timeout on a loaded 2-core
    machine."""
    results = run_worker("mimo:pipeline=2,expert=2,tensor=2,virtual=2")
    assert list(results) == ["pipeline=2,expert=2,tensor=2,virtual=2"]
    for mesh, result in results.items():
        assert result["loss_error"] < TOLERANCE, (mesh, result)
        assert result["grad_error"] < TOLERANCE, (mesh, result)


@pytest.mark.slow
def test_train_step_on_a_mesh_matches_one_device():
    results = run_worker(*MESHES)
    for text in MESHES:
        mesh = text.removeprefix("step:")
        check_mesh_result(mesh, results[mesh], whole_step=text.startswith("step:"))


@pytest.mark.slow
def test_expert_parallel_dispatch_with_skewed_routing_drops_nothing_pallas_and_schedules():
    result = run_worker("ep_skew")
    assert result["busiest_device_share"] > 0.75  # the skew is real: one device gets most
    assert result["copies_computed"] == result["copies_routed"]
    # each device's 8 tokens exchanged 2 at a time (model.moe.ep_chunk_tokens=3): the same
    # outputs, statistics and gradients
    assert max(result["chunked_errors"]) < TOLERANCE, result["chunked_errors"]
    assert result["y_error"] < TOLERANCE
    assert result["stats_error"] < TOLERANCE
    assert result["grad_error"] < TOLERANCE
    assert result["ragged_all_to_all_in_hlo"]  # the GPU/TPU collective lowers
    # Pallas kernels (interpret mode) run per shard under the mesh
    assert result["attention_error"] < TOLERANCE
    assert result["moe_error"] < TOLERANCE
    # the pipeline schedule against the repeats applied in order: uneven GPipe (R=3 on 2
    # stages), interleaved with every chunk real (R=4, V=2) and with an empty one (R=3, V=2)
    errors = result["pipeline_schedule_errors"]
    assert list(errors) == ["R=3,V=1", "R=4,V=2", "R=3,V=2"]
    assert all(error < TOLERANCE for error in errors.values()), errors


# ---- in-process: rules and mesh arithmetic (no devices needed) ---------------------------------


def test_rules_skip_axes_that_do_not_divide_or_are_taken():
    mesh = abstract_mesh({"fsdp": 4, "tensor": 2, "expert": 8})
    assert logical_to_spec(("vocab", "embed"), (64, 32), mesh) == P("tensor", "fsdp")
    assert logical_to_spec(("vocab", "embed"), (63, 30), mesh) == P(None, None)
    assert logical_to_spec(("layers", "expert", "embed", "expert_mlp"), (3, 16, 8, 6),
                           mesh) == P(None, "expert", "fsdp", "tensor")
    # batch -> (data, fsdp, expert): only the axes whose product divides the dimension
    assert logical_to_spec(("batch", "length"), (32, 7), mesh) == P(("fsdp", "expert"), None)
    assert logical_to_spec(("batch", "length"), (4, 7), mesh) == P("fsdp", None)


def test_zero1_adds_data_to_the_largest_dimension_it_divides():
    mesh = abstract_mesh({"data": 4, "fsdp": 2})
    assert zero1_spec(P(None, "fsdp"), (6, 16), mesh) == P(None, ("fsdp", "data"))
    assert zero1_spec(P(None, None), (12, 6), mesh) == P("data", None)
    assert zero1_spec(P(None,), (6,), mesh) == P(None,)  # nowhere to put it


def test_mesh_config_resolves_minus_one_and_rejects_bad_sizes():
    assert MeshConfig().axis_sizes(1) == dict.fromkeys(MESH_AXES, 1)
    assert MeshConfig(expert=2, pipeline=2).axis_sizes(8)["data"] == 2
    assert math.prod(MeshConfig(data=-1, tensor=4).axis_sizes(8).values()) == 8
    with pytest.raises(ValueError, match="needs 16 devices but 8 are available"):
        MeshConfig(data=2, expert=8).axis_sizes(8)
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        MeshConfig(data=-1, fsdp=-1).validate()
    with pytest.raises(ValueError, match="mesh.expert: must be a positive integer or -1"):
        load_run_config(TINY, ["mesh.expert=0"])
    with pytest.raises(ValueError, match="does not divide"):
        MeshConfig(data=-1, expert=3).axis_sizes(8)


def test_mesh_overrides_reach_the_run_config():
    run = load_run_config(TINY, ["mesh.data=2", "mesh.expert=4", "mesh.zero1=false"])
    assert (run.mesh.data, run.mesh.expert, run.mesh.zero1) == (2, 4, False)
    assert run.to_dict()["mesh"]["expert"] == 4


def test_pipeline_needs_a_segment_whose_repeats_the_stages_divide():
    from model.parallel.pipeline import pipelined_segment
    run = load_run_config(TINY)  # F + (SSSF) x 2 with a clamped last layer
    with pytest.raises(ValueError, match="mesh.pipeline=8: no scanned layer segment"):
        pipelined_segment(run.model, 8)
    with pytest.raises(ValueError, match="needs model.scan_layers=true"):
        pipelined_segment(run.model.replace(scan_layers=False), 2)

