"""The weighted task mix (rl/task_mix.py, rl/draw.py, rl/tasks.py, rl/task_config.py):

- the largest-remainder split of P prompts by weight, by hand and as a property;
- sampling a mix: exactly each task's count, task by task, distinct problems of its training
  split; one task draws what the single-task loop drew;
- per-task metrics and a `Draw` (unpacking, metrics, row selection) by hand;
- the `task:` section: a mix, a task written inline, and a run saved before the mix existed,
  which resumes; errors name the field;
- built tasks: held-out problems disjoint from training, the SFT corpus' split;
- the trainer: every draw of a mixed run holds each task's count of prompts (groups adjacent,
  one task each) and the metrics per task are those tasks' rewards and held-out accuracies.
"""

import types

import numpy as np
import pytest
from tiny_rl_model import tiny_model_config
from train_helpers import REPO

import rl.tasks as rl_tasks
from model.config import config_to_dict
from rl.config import load_rl_config, rl_config_from_dict
from rl.draw import Draw, score_draw
from rl.trainer import RLTrainer
from rl.resume import resumed_config
from rl.rewards import RuleVerifier, arithmetic_rewards
from rl.rollout import Rollouts
from rl.task_mix import allocate_prompts, sample_mix, task_metrics
from rl.tasks import build_tasks
from train.data.arithmetic import arithmetic_problems, sample_problems
from train.data.corpus import load_documents
from train.data.documents import split_documents
from train.data.multistep import multistep_problems
from train.loop import TrainingError

MIX = REPO / "configs" / "rl_arith_mix.yaml"

# --------------------------------------------------------------------------------------------
# the split of a batch


@pytest.mark.parametrize("weights, total, counts", [
    ([0.5, 0.5], 64, [32, 32]),
    ([0.5, 0.3, 0.2], 64, [32, 19, 13]),  # quotas 32, 19.2, 12.8: the one left goes to 12.8
    ([3, 1], 4, [3, 1]),
    ([2, 1], 10, [7, 3]),  # 6.67, 3.33
    ([1, 1, 1], 2, [1, 1, 0]),  # equal remainders: the earlier tasks first
    ([1, 1, 1], 4, [2, 1, 1]),
    ([0.1, 0.2, 0.7], 10, [1, 2, 7]),  # float quotas just under an integer still round right
    ([5], 7, [7]),
])
def test_allocate_prompts_by_largest_remainder(weights, total, counts):
    assert allocate_prompts(weights, total) == counts


def test_allocation_sums_to_the_total_and_stays_within_one_of_each_quota():
    rng = np.random.default_rng(0)
    for _ in range(200):
        weights = rng.uniform(0.01, 1.0, size=rng.integers(1, 6)).tolist()
        total = int(rng.integers(1, 300))
        counts = allocate_prompts(weights, total)
        assert sum(counts) == total
        for count, weight in zip(counts, weights):
            assert abs(count - total * weight / sum(weights)) < 1.0


def fake_task(name, weight, size):
    return types.SimpleNamespace(name=name, weight=weight,
                                 train=[f"{name}-{i}" for i in range(size)])


def test_sample_mix_honours_the_weights_in_every_batch():
    tasks = [fake_task("a", 0.5, 50), fake_task("b", 0.3, 40), fake_task("c", 0.2, 30)]
    for seed in range(5):
        rows = sample_mix(tasks, 64, np.random.default_rng(seed))
        names = [task.name for task, _ in rows]
        assert names == ["a"] * 32 + ["b"] * 19 + ["c"] * 13  # task by task, exact counts
        for task in tasks:
            drawn = [p for t, p in rows if t is task]
            assert len(set(drawn)) == len(drawn) and set(drawn) <= set(task.train)
    one = fake_task("a", 1.0, 50)
    rows = sample_mix([one], 16, np.random.default_rng(3))
    assert [p for _, p in rows] == sample_problems(one.train, 16, np.random.default_rng(3))


def test_task_metrics_are_per_task_means():
    tasks = np.array(["a", "a", "b", "b", "b", "a"])
    values = {"reward": np.array([1.0, 0.0, 0.5, 0.5, 0.2, 0.5]),
              "accuracy": np.array([True, False, False, False, True, False])}
    got = task_metrics(["a", "b", "c"], tasks, values)
    assert got == pytest.approx({"reward/a": 0.5, "accuracy/a": 1 / 3,
                                 "reward/b": 0.4, "accuracy/b": 1 / 3})  # c: no rows, no metric


def fake_rollouts(rows):
    return Rollouts(tokens=np.arange(rows * 3).reshape(rows, 3), segment_ids=np.ones((rows, 3)),
                    mask=np.ones((rows, 3), np.float32), infer_logp=np.zeros((rows, 3)),
                    truncated=np.arange(rows) % 2 == 0, responses=[[i] for i in range(rows)])


def test_score_draw_scores_each_task_with_its_reward_and_verifier():
    class Constant:  # a stand-in judge: the same reward for every response
        def score(self, problems, responses):
            return np.full(len(problems), 0.25, np.float32)

    verifier = RuleVerifier(arithmetic_rewards)
    exact = types.SimpleNamespace(name="exact", reward=verifier, verifier=verifier)
    judged = types.SimpleNamespace(name="judged", reward=Constant(), verifier=verifier)
    problems = arithmetic_problems(max_operand=3)[:4]  # 0+0, 0+1, 0+2, 0+3
    rows = [(exact, problems[0]), (exact, problems[1]), (judged, problems[2]),
            (judged, problems[3])]
    drawn = score_draw(fake_rollouts(4), rows, ["0", "7", "2", "x"])
    np.testing.assert_array_equal(drawn.rewards, np.float32([1.0, 0.0, 0.25, 0.25]))
    np.testing.assert_array_equal(drawn.correct, [True, False, True, False])
    assert list(drawn.tasks) == ["exact", "exact", "judged", "judged"]
    assert drawn.metrics(["exact", "judged"]) == pytest.approx({
        "reward": 0.375, "accuracy": 0.5, "reward/exact": 0.5, "accuracy/exact": 0.5,
        "reward/judged": 0.25, "accuracy/judged": 0.5,
        "response_length/exact": 3.0, "response_length/judged": 3.0})  # 3 mask tokens a row

    kept = drawn.select_rows(np.array([False, True, True, False]))
    assert isinstance(kept, Draw) and list(kept.tasks) == ["exact", "judged"]
    assert kept.problems == [problems[1], problems[2]]
    np.testing.assert_array_equal(kept.rewards, np.float32([0.0, 0.25]))
    np.testing.assert_array_equal(kept.rollouts.tokens, [[3, 4, 5], [6, 7, 8]])
    np.testing.assert_array_equal(kept.rollouts.truncated, [False, True])
    assert kept.rollouts.responses == [[1], [2]]


# --------------------------------------------------------------------------------------------
# the task: section


def test_mix_config_and_inline_task():
    run = load_rl_config(MIX)
    assert [(t.name, t.kind, t.weight, t.max_operand, t.ops, t.reward) for t in run.task.tasks] \
        == [("arithmetic", "arithmetic", 0.5, 99, "+-", "verifier"),
            ("multistep", "multistep", 0.5, 20, "+-", "verifier")]
    # defaults come from the kind; the saved form reads back to the same config
    bare = load_rl_config(MIX, ["task.tasks={arithmetic: {weight: 2}, multistep: null}"])
    assert [(t.max_operand, t.weight) for t in bare.task.tasks] == [(99, 2), (20, 1.0)]
    assert rl_config_from_dict(run.to_dict()).task == run.task
    # a second domain of the same kind under its own name
    twice = load_rl_config(MIX, ["task.tasks.small={kind: arithmetic, max_operand: 9}"])
    assert [(t.name, t.kind) for t in twice.task.tasks][-1] == ("small", "arithmetic")

    inline = load_rl_config(REPO / "configs" / "rl_arith.yaml", ["task.max_operand=49"])
    (task,) = inline.task.tasks
    assert (task.name, task.kind, task.weight, task.max_operand) == ("arithmetic", "arithmetic",
                                                                     1.0, 49)
    assert inline.to_dict()["task"]["tasks"]["arithmetic"]["max_operand"] == 49


@pytest.mark.parametrize("override, message", [
    ("task.max_operand=5", "task.max_operand: with task.tasks it belongs to a task "
                           "(task.tasks.<name>.max_operand)"),
    ("task.tasks.multistep.max_operand=60", "task.tasks.multistep.max_operand: must be <= 49"),
    ("task.tasks.multistep.ops=+*", "task.tasks.multistep.ops: must be a non-empty string of + -"),
    ("task.tasks.geometry={}", "task.tasks.geometry.kind: got 'geometry'"),
    ("task.tasks.multistep.weight=0", "task.tasks.multistep.weight: must be a positive number"),
    ("task.tasks.multistep.weight=0.001", "task.tasks.multistep.weight: 0.001 of "
                                          "rl.prompts_per_iteration=64 prompts rounds to none"),
    ("task.tasks.multistep.reward=judge", "task.tasks.multistep.judge.checkpoint: required"),
    ('task.tasks.multistep.judge.template="Q: {question}"',
     "task.tasks.multistep.judge.template: missing placeholder {response_a}, {response_b}"),
    ("task.tasks.multistep.name=x", "task.tasks.multistep.name: a task of task.tasks is named"),
    ("task.tasks=[]", "task.tasks: expected a mapping of task names to tasks"),
])
def test_bad_task_fields_are_named(override, message):
    with pytest.raises(ValueError) as info:
        load_rl_config(MIX, [override])
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_a_run_saved_before_the_mix_resumes(tmp_path):
    """Checkpoints record the task section as written then: one task inline."""
    run = load_rl_config(REPO / "configs" / "rl_arith.yaml")
    saved = {"model": None, "rl": config_to_dict(run.rl),
             "task": {"name": "arithmetic", "max_operand": 99, "ops": "+-",
                      "heldout_fraction": 0.05}}
    assert resumed_config(run, saved, tmp_path).task == run.task
    mixed = load_rl_config(MIX, ["rl.max_new_tokens=6", "rl.eval_prompts=0"])
    with pytest.raises(TrainingError, match=r"task\.tasks\.multistep\.\w+"):
        resumed_config(mixed, saved, tmp_path)


def test_built_tasks_hold_out_what_the_sft_corpus_holds_out():
    arithmetic, multistep = build_tasks(load_rl_config(MIX).task)
    assert (arithmetic.name, multistep.name) == ("arithmetic", "multistep")
    assert arithmetic.reward is arithmetic.verifier
    for task, source, problems in [(arithmetic, "arith", arithmetic_problems()),
                                   (multistep, "arith_multistep", multistep_problems())]:
        train, heldout = {p.key for p in task.train}, {p.key for p in task.heldout}
        assert train and heldout and not train & heldout
        assert train | heldout == {p.key for p in problems}
        sft_train, sft_heldout = split_documents(load_documents(source), 0.05)
        assert {d.key for d in sft_heldout} == heldout and {d.key for d in sft_train} == train


# --------------------------------------------------------------------------------------------
# the trainer


@pytest.mark.slow
def test_every_draw_of_a_mixed_run_honours_the_weights(tmp_path, monkeypatch):
    """Arithmetic responses all count as right and multi-step ones all as wrong (verifiers
    patched; a random policy answers nothing right), so every per-task metric is known."""
    arithmetic_problems_of, _ = rl_tasks.KINDS["arithmetic"]
    multistep_problems_of, _ = rl_tasks.KINDS["multistep"]
    monkeypatch.setitem(rl_tasks.KINDS, "arithmetic", (
        arithmetic_problems_of, lambda responses, answers: np.ones(len(responses), np.float32)))
    monkeypatch.setitem(rl_tasks.KINDS, "multistep", (
        multistep_problems_of, lambda responses, answers: np.zeros(len(responses), np.float32)))
    run = rl_config_from_dict({
        "model": config_to_dict(tiny_model_config()),
        "rl": {"iterations": 1, "prompts_per_iteration": 4, "samples_per_prompt": 2,
               "max_new_tokens": 3, "actor_minibatches": 2, "critic_minibatches": 2,
               "advantages": "group",
               "eval_prompts": 3, "progress": False, "actor": {"lr": 1e-3, "warmup_steps": 0}},
        "task": {"tasks": {"arithmetic": {"weight": 3, "max_operand": 9},
                           "multistep": {"weight": 1, "max_operand": 4}}}})
    trainer = RLTrainer(run, tmp_path)
    try:
        state = trainer.initial_state()
        seen = []
        for iteration, draw in [(0, 0), (0, 1), (1, 0)]:
            drawn = trainer.draw(state, iteration, draw)
            rollouts, rewards = drawn.rollouts, drawn.rewards
            assert rollouts.tokens.shape[0] == rewards.shape[0] == 8
            # 3 arithmetic and 1 multi-step prompt, 2 adjacent samples each
            assert list(drawn.tasks) == ["arithmetic"] * 6 + ["multistep"] * 2
            assert all(drawn.problems[2 * g] == drawn.problems[2 * g + 1] for g in range(4))
            for task in trainer.tasks:
                problems = [p for p, t in zip(drawn.problems, drawn.tasks) if t == task.name]
                assert {p.key for p in problems} <= {p.key for p in task.train}
            np.testing.assert_array_equal(rewards, [1.0] * 6 + [0.0] * 2)
            seen.append(drawn.problems)
        assert seen[0] != seen[1] != seen[2]

        state, metrics = trainer.iteration(state, 0)
        assert metrics["reward/arithmetic"] == metrics["accuracy/arithmetic"] == 1.0
        assert metrics["reward/multistep"] == metrics["accuracy/multistep"] == 0.0
        assert metrics["reward"] == metrics["accuracy"] == 0.75  # 6 of 8 rows
        scores = trainer.evaluate(state)
        for name in ("eval/accuracy", "eval/sample_accuracy"):
            assert scores[f"{name}/arithmetic"] == 1.0 and scores[f"{name}/multistep"] == 0.0
            assert scores[name] == 0.5  # 3 held-out problems of each task, pooled
    finally:
        trainer.checkpoints.close()
