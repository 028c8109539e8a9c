"""RL under a mesh (rl/parallel.py): a tiny RL run on a 2 x 2 mesh of CPU devices equals the
same run on one device, as a train step does in tests/train/test_parallel.py; `rl.mesh` is read,
checked and may change on resume. The 4-device runs happen in a subprocess
(tests/rl/rl_mesh_worker.py) because the device count is fixed when JAX starts."""

from pathlib import Path

import jax
import pytest
from test_rl_loop import small_run
from train_helpers import run_device_worker

from model.parallel.rules import abstract_mesh
from rl.parallel import check_rows_fit, rl_mesh
from rl.resume import resumed_config
from train.loop import TrainingError

WORKER = Path(__file__).resolve().parent / "rl_mesh_worker.py"
# float32 with another reduction order (rows split over devices, experts computed on the
# devices that own them): the per-iteration metrics moved by <= 2.2e-5 relative (the KL of the
# second iteration, itself ~2e-4) on this mesh and on data=2,tensor=2 and fsdp=2,tensor=2 (the
# worker takes any mesh). The optimizers amplify that: Muon orthogonalises per-expert gradients
# of a few routed tokens (nearly rank-deficient, so their small directions carry round-off) and
# Adam's first steps divide by tiny second moments. The actor's whole update after 4 minibatch
# steps differed by 2.0e-4 of its norm (routed experts and the 2 KV heads' projections most,
# ~7e-4 each), any param tensor by <= 5.1e-5 of its norm (tests/train/test_multihost.py measured
# 3e-4 for the same reason). A sharding error (a wrong layout, rows or tokens dropped or
# counted twice) changes these by O(1).
METRIC_TOLERANCE = 1e-4
UPDATE_TOLERANCE = 2e-3
PARAM_TOLERANCE = 2e-4
MESH = "data=2,expert=2"


def run_worker(*args: str) -> dict:
    return run_device_worker(WORKER, 4, *args)


@pytest.mark.slow
def test_rl_on_a_2x2_mesh_matches_one_device():
    """Two iterations (rollouts, scoring, critic values, 2 actor and 2 critic minibatch steps
    each, held-out evaluation; Rollout Routing Replay on) with MoE experts spread over `expert`
    and rows over data x expert.
    Inference in float32 (`rl.inference_dtype`): in bfloat16 the other reduction order moves
    pi_infer by ~1e-3, enough to flip a sampled token or MIS-PO's trajectory filter
    [0.996, 1.001], and the runs would legitimately part ways."""
    results = run_worker(MESH)
    one, mesh = results["one"], results[MESH]
    assert mesh["iterations"] == [0, 2]
    assert [r["step"] for r in mesh["metrics"]] == [r["step"] for r in one["metrics"]] == [0, 1, 2]
    for got, want in zip(mesh["metrics"], one["metrics"]):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=METRIC_TOLERANCE, abs=1e-9), (key, got)
    # The rollouts are the same tokens: rewards (from the sampled text) and lengths exactly.
    for got, want in zip(mesh["metrics"][1:], one["metrics"][1:]):
        assert (got["reward"], got["response_length"]) == (want["reward"], want["response_length"])
        assert 0 < want["reward"] < 1 and want["actor/grad_norm"] > 0.1  # a real update
    assert mesh["actor_update_error"] < UPDATE_TOLERANCE
    for key in ("actor_param_error", "critic_param_error", "opt_state_error"):
        assert mesh[key] < PARAM_TOLERANCE, (key, mesh[key])
    # Layouts read off the rules table by hand: routed experts [layers, expert, embed,
    # expert_mlp] = [1, 4, 32, 16] over `expert`; ZeRO-1 adds `data` to the Muon momentum's
    # largest dimension it divides (embed, 32); the reference like the actor's params; the
    # critic's backbone like the policy's; attention has no `tensor` axis to use.
    layouts = mesh["layouts"]
    assert layouts["actor_expert_gate"] == [None, "expert", None, None]
    assert layouts["actor_expert_gate_momentum"] == [None, "expert", "data", None]
    assert layouts["reference_expert_gate"] == layouts["critic_expert_gate"] == [
        None, "expert", None, None]
    assert layouts["actor_q_proj"] == [None, None, None, None]
    # The one-device checkpoint restored onto the mesh (a resume may change rl.mesh): the
    # same numbers, in the mesh's layout.
    assert mesh["restored_error"] == 0.0
    assert mesh["restored_expert_gate"] == [None, "expert", None, None]


# ---- in-process: config, row checks and resume (no devices needed) -----------------------------


def test_rl_mesh_config_reads_overrides_and_refuses_pipeline():
    run = small_run(mesh={"data": 2, "expert": 2})
    assert (run.rl.mesh.data, run.rl.mesh.expert, run.rl.mesh.zero1) == (2, 2, True)
    assert small_run().rl.mesh.data == -1  # every device data-parallel, as training
    with pytest.raises(ValueError, match=r"^rl\.mesh\.pipeline: RL does not pipeline"):
        small_run(mesh={"pipeline": 2})
    with pytest.raises(ValueError, match=r"^rl\.mesh\.tensor: must be a positive integer"):
        small_run(mesh={"tensor": 0})


def test_rows_must_split_over_the_data_parallel_devices():
    mesh = abstract_mesh({"data": 2, "expert": 2})  # 4 data-parallel devices
    check_rows_fit(small_run(prompts_per_iteration=2, samples_per_prompt=4).rl, mesh)
    with pytest.raises(TrainingError) as err:  # 2 x 2 = 4 rollouts: minibatches of 2 rows
        check_rows_fit(small_run().rl, mesh)
    assert str(err.value) == ("rl.actor_minibatches: 2 minibatches of 2 rollouts do not split "
                              "over the 4 data-parallel devices (rl.mesh data x fsdp x expert)")
    with pytest.raises(TrainingError, match=r"^rl\.critic_minibatches: 4 minibatches of 2 "):
        check_rows_fit(small_run(prompts_per_iteration=2, samples_per_prompt=4,
                                 critic_minibatches=4).rl, mesh)
    with pytest.raises(TrainingError, match=r"^rl\.prompts_per_iteration x "
                                            r"rl\.samples_per_prompt: 6 rollouts do not split"):
        check_rows_fit(small_run(prompts_per_iteration=3, actor_minibatches=1,
                                 critic_minibatches=1).rl, mesh)
    # Group advantages train no critic: only the actor's minibatches count.
    check_rows_fit(small_run(prompts_per_iteration=2, samples_per_prompt=4, advantages="group",
                             critic_minibatches=4).rl, mesh)


def test_a_mesh_the_devices_cannot_hold_is_one_line_naming_rl_mesh():
    with pytest.raises(TrainingError) as err:
        rl_mesh(small_run(mesh={"data": len(jax.devices()) + 1}).rl.mesh)
    assert str(err.value).startswith("rl.mesh: data=") and "\n" not in str(err.value)


def test_a_resumed_run_may_change_the_mesh_but_not_the_batch(tmp_path):
    saved = small_run(mesh={"data": 1}).to_dict()
    resumed = resumed_config(small_run(mesh={"data": 2, "tensor": 2}), saved, tmp_path)
    assert (resumed.rl.mesh.data, resumed.rl.mesh.tensor) == (2, 2)
    with pytest.raises(TrainingError, match="rl.samples_per_prompt"):
        resumed_config(small_run(samples_per_prompt=4), saved, tmp_path)
