"""Runs in a subprocess with 4 CPU devices (tests/rl/test_rl_mesh.py): a tiny RL run on one
device, then the same run on each MESH given; both final checkpoints are restored into the
mesh's shardings (the one-device one as a resumed run on the mesh would). Prints one JSON
object; the test asserts on it.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/rl/rl_mesh_worker.py MESH...

MESH: comma-separated rl.mesh axis=size, e.g. `data=2,expert=2`.
"""

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from test_rl_loop import small_run  # noqa: E402

import rl.loop as rl_loop  # noqa: E402
import rl.trainer as rl_trainer  # noqa: E402
import rl.tasks as rl_tasks  # noqa: E402
from model.parallel.rules import use_mesh  # noqa: E402
from train.telemetry.metrics import read_metrics  # noqa: E402

# 2 prompts x 4 samples: 8 rollouts, two minibatches of 4 rows for actor and critic, which
# split over up to 4 data-parallel devices. float32 inference: see the test's docstring. The
# decoder records the routed experts and the training forwards replay them (rl.routing_replay):
# the recorded [B, L_moe, T, k] rows split over the devices like the other rows.
RUN = dict(iterations=2, prompts_per_iteration=2, samples_per_prompt=4, eval_prompts=4,
           inference_dtype="float32", truncation_bootstrap=False, xla_cache_dir="",
           routing_replay=True)
COMPARED = ("reward", "response_length", "entropy", "kl", "actor/loss", "actor/grad_norm",
            "critic/loss", "critic/grad_norm", "advantage_rms", "value_mean",
            "routing_confidence", "token_keep_frac", "traj_keep_frac", "eval/accuracy",
            "eval/sample_accuracy", "replay/topk_mismatch", "actor/replay_topk_mismatch")


def odd_length_reward(texts, answers):
    """1 for a response of odd length: a random policy answers no sum right, and rewards that
    depend on the sampled tokens give both the critic and the actor something to learn."""
    return np.float32([len(t) % 2 for t in texts])


def final_state(run, workdir: Path, devices):
    """The run's last checkpoint, restored into the shardings of its mesh over `devices`."""
    trainer = rl_trainer.RLTrainer(run, workdir, devices=devices)
    try:
        with use_mesh(trainer.mesh):
            return trainer.initial_state()
    finally:
        trainer.checkpoints.close()


def metrics(workdir: Path) -> list[dict]:
    return [{k: r[k] for k in COMPARED if k in r} | {"step": r["step"]}
            for r in read_metrics(workdir / "metrics.jsonl")]


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def relative_error(got: list, want: list) -> float:
    """Largest relative L2 error over the leaves."""
    return max(float(np.linalg.norm(g - w) / (np.linalg.norm(w) + 1e-30))
               for g, w in zip(got, want))


def update_error(state, reference_state) -> float:
    """Relative L2 error of the whole actor update (params - initial params, i.e. - reference),
    over all leaves together: the part of the params the two runs compute differently."""
    got = [p - r for p, r in zip(leaves(state.actor.params), leaves(state.reference))]
    want = [p - r for p, r in zip(leaves(reference_state.actor.params),
                                  leaves(reference_state.reference))]
    difference = sum(float(np.sum((g - w) ** 2)) for g, w in zip(got, want))
    return float(np.sqrt(difference / sum(float(np.sum(w ** 2)) for w in want)))


def spec_of(tree, *names) -> list:
    """PartitionSpec entries of the first leaf whose key path contains `names` in order."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        at = 0
        for key in keys:
            at += at < len(names) and key == names[at]
        if at == len(names):
            spec = list(leaf.sharding.spec) + [None] * (leaf.ndim - len(leaf.sharding.spec))
            return [list(e) if isinstance(e, tuple) else e for e in spec]
    raise KeyError(names)


def main(meshes: list[str]) -> dict:
    problems, _ = rl_tasks.KINDS["arithmetic"]
    rl_tasks.KINDS["arithmetic"] = (problems, odd_length_reward)
    root = Path(tempfile.mkdtemp())
    one_run = small_run(**RUN, mesh={"data": 1})
    rl_loop.run_rl(one_run, root / "one", devices=jax.devices()[:1])
    one = final_state(one_run, root / "one", jax.devices()[:1])
    results = {"one": {"metrics": metrics(root / "one")}}
    for text in meshes:
        sizes = {k: int(v) for k, v in (item.split("=") for item in text.split(","))}
        run = small_run(**RUN, mesh={"data": 1, **sizes})
        workdir = root / text
        summary = rl_loop.run_rl(run, workdir)
        state = final_state(run, workdir, jax.devices())
        moved = final_state(run, root / "one", jax.devices())  # saved on one device
        results[text] = {
            "iterations": [summary.first_iteration, summary.last_iteration],
            "metrics": metrics(workdir),
            "actor_param_error": relative_error(leaves(state.actor.params),
                                                leaves(one.actor.params)),
            "actor_update_error": update_error(state, one),
            "critic_param_error": relative_error(leaves(state.critic.params),
                                                 leaves(one.critic.params)),
            "opt_state_error": relative_error(leaves(state.actor.opt_state),
                                              leaves(one.actor.opt_state)),
            "restored_error": relative_error(leaves(moved), leaves(one)),
            "restored_expert_gate": spec_of(moved.actor.params, "moe", "gate_proj"),
            "layouts": {
                "actor_expert_gate": spec_of(state.actor.params, "moe", "gate_proj"),
                "actor_expert_gate_momentum": spec_of(state.actor.opt_state, "moe",
                                                      "gate_proj"),
                "reference_expert_gate": spec_of(state.reference, "moe", "gate_proj"),
                "critic_expert_gate": spec_of(state.critic.params, "moe", "gate_proj"),
                "actor_q_proj": spec_of(state.actor.params, "q_proj"),
            },
        }
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
