"""On-policy distillation in the RL loop, on tiny random models (tests/rl/test_rl_loop.py's
`small_run` sizes) with two domain tasks, add ("+") and sub ("-"), each with its teacher:

- MOPD (token signal): the per-task metrics, the teacher term in the advantages (a random policy
  answers nothing right, so every outcome advantage is 0 and what remains is the teacher's), and
  a run interrupted after one iteration and resumed (teachers reloaded from the config) matching
  the straight run;
- an RL workdir as a policy (`model.weights.load_model`: its actor, as the trainer restores it)
  and as the run-wide teacher of PPO with the full-vocabulary KL;
- MIS-PO with the token signal, its teacher's weight w_i scaling the teacher term.
"""

import flax.linen as nn
import jax
import numpy as np
import pytest
from test_rl_loop import small_run

import rl.distill.distillation as distillation
from model.interop.model_dir import save_model_dir
from model.lm import CausalLM, init_variables
from model.parallel.rules import use_mesh
from model.weights import load_model
from rl.config import rl_config_from_dict
from rl.distill.signal import distill_advantages
from rl.loop import run_rl
from rl.trainer import RLTrainer
from train.telemetry.metrics import read_metrics


def distill_run(teachers, weights=None, **rl_overrides):
    """`small_run` with tasks add and sub (teachers: {task: checkpoint}, "" for none; weights:
    {task: its teacher's weight}, 1 for the others)."""
    run = small_run().to_dict()
    run["rl"].update(rl_overrides)
    run["task"] = {"tasks": {
        name: {"kind": "arithmetic", "ops": ops, "max_operand": 9,
               "teacher": {"checkpoint": str(teachers.get(name, "")),
                           "tokenizer": "arith_chars" if teachers.get(name) else "",
                           "weight": (weights or {}).get(name, 1.0)}}
        for name, ops in (("add", "+"), ("sub", "-"))}}
    return rl_config_from_dict(run)


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """Two random teachers of the student's architecture, as model directories."""
    root = tmp_path_factory.mktemp("teachers")
    cfg = small_run().model
    for name, seed in (("add", 11), ("sub", 12)):
        variables = nn.meta.unbox(jax.jit(lambda k: init_variables(CausalLM(cfg), k))(
            jax.random.key(seed)))
        save_model_dir(cfg, variables, root / name)
    return {"add": root / "add", "sub": root / "sub"}


def iteration_records(workdir):
    return [r for r in read_metrics(workdir / "metrics.jsonl") if r["step"] > 0]


@pytest.mark.slow
def test_mopd_metrics_teacher_advantages_and_resume(tmp_path, teachers):
    run = distill_run(teachers, algorithm="mopd")
    straight = run_rl(run, tmp_path / "straight")
    records = iteration_records(straight.workdir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["reward"] == 0.0  # a random policy: every outcome advantage is 0 ...
        assert r["advantage_rms"] > 1e-3  # ... and the teacher's log-ratio remains
        for task in ("add", "sub"):
            for key in (f"distill/kl/{task}", f"distill/teacher_logp/{task}",
                        f"response_length/{task}", f"accuracy/{task}"):
                assert np.isfinite(r[key]), (key, r)
            assert r[f"distill/teacher_logp/{task}"] < 0
        assert 0 <= r["distill/w_kept_frac"] <= 1 and 0 <= r["actor/w_kept_frac"] <= 1
        assert np.isfinite([r["actor/loss"], r["actor/grad_norm"]]).all() and r["actor/grad_norm"] > 0
        assert not [k for k in r if k.startswith("critic/")], r  # MOPD: group advantages

    first = run_rl(run, tmp_path / "resumed", stop_after=1)
    assert first.interrupted and first.last_iteration == 1
    second = run_rl(run, tmp_path / "resumed")
    assert (second.first_iteration, second.last_iteration) == (1, 2)
    resumed = iteration_records(second.workdir)
    for key in ("reward", "actor/loss", "actor/grad_norm", "distill/kl/add", "distill/kl/sub",
                "distill/teacher_logp/sub", "advantage_rms", "eval/accuracy"):
        assert resumed[-1][key] == pytest.approx(records[-1][key], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
def test_an_rl_workdir_is_a_policy_and_a_full_vocab_teacher_of_ppo(tmp_path, teachers):
    source = run_rl(distill_run(teachers, algorithm="mopd", iterations=1), tmp_path / "source")
    trainer = RLTrainer(distill_run(teachers, algorithm="mopd", iterations=1), source.workdir)
    try:
        with use_mesh(trainer.mesh):
            restored = trainer.initial_state().actor.params
    finally:
        trainer.checkpoints.close()
    config, variables = load_model(source.workdir)
    assert config == small_run().model
    assert jax.tree.all(jax.tree.map(np.array_equal, variables["params"], restored))

    run = distill_run({}, algorithm="ppo", iterations=1,
                      distill={"signal": "full_vocab", "teacher_coef": 0.5,
                               "teacher": {"checkpoint": str(source.workdir)}})
    [record] = iteration_records(run_rl(run, tmp_path / "ppo").workdir)
    # Outcome advantages are 0 (reward 0, a critic that starts at 0) and the full-vocab signal
    # adds nothing to them; the gradient is the KL's.
    assert record["reward"] == 0.0 and record["advantage_rms"] == 0.0
    assert 0 < record["actor/teacher_kl"] < 10 and record["actor/grad_norm"] > 0
    assert np.isfinite([record["distill/kl/add"], record["distill/kl/sub"]]).all()


@pytest.mark.slow
def test_mis_po_takes_the_weighted_teacher_term_in_its_advantages(tmp_path, teachers,
                                                                   monkeypatch):
    """The add task's teacher with weight w = 2.5 (V4's w_i), no outcome term: the advantages
    the update gets are 2.5 (log pi_teacher - log pi_old) on add rows and 0 on sub rows."""
    seen = []

    def recording(*args, **kwargs):
        seen.append((args, distill_advantages(*args, **kwargs)))
        return seen[-1][1]

    monkeypatch.setattr(distillation, "distill_advantages", recording)
    run = distill_run({"add": teachers["add"]}, {"add": 2.5}, algorithm="mis_po", iterations=1,
                      advantages="group", distill={"outcome_coef": 0.0})
    [record] = iteration_records(run_rl(run, tmp_path / "mis_po").workdir)
    assert record["advantage_rms"] > 1e-3 and record["actor/grad_norm"] > 0
    assert "distill/kl/add" in record and "distill/kl/sub" not in record  # sub: no teacher
    assert record["distill/kl"] == record["distill/kl/add"]
    [((teacher_logp, old_logp, _, mask, weights, *_), advantages)] = seen
    add = weights > 0
    assert add.any() and not add.all() and set(weights.tolist()) == {0.0, 2.5}
    np.testing.assert_allclose(advantages[add], (2.5 * (teacher_logp - old_logp) * mask)[add],
                               rtol=1e-5, atol=1e-6)
    assert not advantages[~add].any()
