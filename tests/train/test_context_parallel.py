"""Context parallelism on 8 CPU devices (docs/parallelism.md, "Context parallelism"): with each
sequence split over `context` (alone, with `data`, and with `pipeline` and `expert`), the loss
and gradients of the tiny Step 3.5, MiMo-V2-Flash and DeepSeek-V4 models equal one device's,
on packed documents that cross the shard boundaries, with windows longer and shorter than a
chunk. The 8-device runs happen in a subprocess (tests/context_worker.py)."""

from pathlib import Path

import pytest
from train_helpers import TINY, run_device_worker

from model.parallel.context import context_layout
from model.parallel.rules import abstract_mesh
from train.config import load_run_config
from train.parallel.sharding import check_batch_fits

WORKER = Path(__file__).resolve().parents[1] / "context_worker.py"
TOLERANCE = 1e-5  # relative, float32 with a different reduction order


def check(results: dict, meshes: tuple, grad_tolerance: float = TOLERANCE) -> None:
    assert sorted(k for k in results if k not in ("exchanges", "cores")) == sorted(meshes)
    for mesh in meshes:
        result = results[mesh]
        assert result["loss_error"] < TOLERANCE, (mesh, result)
        assert result["grad_error"] < grad_tolerance, (mesh, result)
        # the attention sublayers' parameters, which the exchanges feed: always tight
        assert result["attention_grad_error"] < TOLERANCE, (mesh, result)


@pytest.mark.slow
def test_step35_with_context_matches_one_device_and_the_exchanges_and_cores_match():
    """S and F layers (balanced layout), MoE with a shared expert, an MTP head whose shifted
    targets cross the shards; `context=8`: chunks of 4 rows under a window of 8 (two permute
    hops); `context=4,data=2`: chunks of 8; the F x 2 segment in two pipeline stages with the
    experts over `expert`."""
    meshes = ("context=8", "context=4,data=2", "pipeline=2,context=2,expert=2")
    results = run_device_worker(WORKER, 8, "s35", "exchanges", *meshes)
    check(results, meshes)
    for layout, errors in results["exchanges"].items():
        assert all(error == 0 for error in errors.values()), (layout, errors)
    # the window and full cores per shard (Pallas in interpret mode, XLA) against one device
    assert sorted(results["cores"]) == ["pallas,window=8", "pallas,window=None",
                                        "xla,window=8", "xla,window=None"]
    assert all(error < 1e-5 for error in results["cores"].values()), results["cores"]


@pytest.mark.slow
def test_mimo_with_context_matches_one_device():
    """Sinks on the SWA layers and the MTP block, per-type KV heads and head dims, values
    narrower than keys (window 9: 8 rows of halo, one hop at context=4, two at context=8)."""
    meshes = ("context=8", "context=4,data=2")
    check(run_device_worker(WORKER, 8, "mimo", *meshes), meshes)


# mHC's head biases and gates get sums over every token of largely cancelling terms (gradient
# norms ~1e-8): data parallelism alone moves them by ~1e-3 relative (test_parallel.py), so the
# whole-model bound is that one; the attention parameters are held to TOLERANCE.
V4_GRAD_TOLERANCE = 5e-3


@pytest.mark.slow
def test_deepseek_v4_with_context_matches_one_device():
    """W, C (sparse: the indexer's top-k over the gathered entries) and H layers, mHC streams,
    hash routing, the MTP layer block; T = 32: context=8 gives chunks of 4 tokens under a
    window of 8 and CSA blocks of 2 whose overlap reaches into the chunk before; the two W
    layers in two pipeline stages with the experts over `expert`."""
    meshes = ("context=8", "pipeline=2,context=2,expert=2")
    check(run_device_worker(WORKER, 8, "v4", *meshes), meshes, V4_GRAD_TOLERANCE)


@pytest.mark.slow
def test_deepseek_v4_dense_csa_in_the_balanced_layout_matches_one_device():
    """CSA attending to every visible entry with the indexer's KL over all of them (its sums
    added over the mesh), the compression of two chunks per shard (balanced layout) with the
    batch over `data`."""
    meshes = ("context=4,data=2,layout=balanced",)
    check(run_device_worker(WORKER, 8, "v4dense", *meshes), meshes, V4_GRAD_TOLERANCE)


# ---- in-process: layouts and errors (no devices needed) ---------------------------------------


def test_balanced_layout_where_there_are_full_attention_layers():
    run = load_run_config(TINY)  # F + (SSSF) x 2
    assert context_layout(run.model, 4).slots == 2
    assert context_layout(run.model.replace(context_layout="contiguous"), 4).slots == 1
    assert context_layout(run.model.replace(layout="S" * 9), 4).slots == 1
    assert context_layout(run.model, 1).chunks == 1  # no context: nothing to cut


def test_a_sequence_that_does_not_split_into_the_chunks_is_refused():
    overrides = ["train.seq_len=100", "train.batch_size=8"]
    mesh = abstract_mesh({"context": 4, "data": 2})
    with pytest.raises(ValueError, match="train.seq_len: 100 tokens do not split into the 8 "
                                         "chunks of mesh.context=4"):
        check_batch_fits(load_run_config(TINY, overrides), mesh)
    check_batch_fits(load_run_config(TINY, [*overrides, "model.context_layout=contiguous"]), mesh)


def test_rl_refuses_a_context_axis():
    from rl.mesh_config import RLMeshConfig
    with pytest.raises(ValueError, match="rl.mesh.context: RL does not split sequences"):
        RLMeshConfig(context=2)
