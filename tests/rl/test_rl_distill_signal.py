"""On-policy distillation's arithmetic (rl/distill/signal.py, rl/distill/full_vocab.py,
`mopd_loss` in rl/objectives/losses.py, the `rl.distill` config) against float64 loops written
here on hand-made log-probs, never against the code under test:

- the token-level advantage teacher_coef * w_i * (log pi_teacher - log pi_old) + alpha *
  A_outcome with each row's teacher weight w_i (V4 eq. 29), the teacher term only on rows with
  a teacher, and the full_vocab signal's outcome-only one;
- MOPD (MiMo eqs. 7-8): the truncated weight w_t (closed bounds, dropped outside), the
  sequence-mean aggregation, the gradient (w_t under a stop-gradient), `actor_loss` dispatch
  with the full-vocabulary KL term weighted by its row's teacher weight; the kept-weight fraction and the per-task KL metrics;
- the full-vocabulary reverse KL with a larger teacher vocabulary against numpy;
- config errors name the field.
"""

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.config import RLConfig, load_rl_config, rl_config_from_dict
from rl.distill.config import DistillConfig, TeacherConfig, task_teachers
from rl.distill.full_vocab import reverse_kl
from rl.distill.signal import distill_advantages, kept_weight_fraction, teacher_metrics
from rl.objectives import losses
from rl.task_config import task_config_from_dict
from rl.update import actor_loss

# Two responses: row 0 has 3 response tokens, row 1 has 2 (position 0 is the prompt).
MASK = np.array([[0, 1, 1, 1], [0, 1, 1, 0]], np.float64)
OLD = np.array([[0.0, -1.0, -0.5, -2.0], [0.0, -0.25, -3.0, 0.0]])
TEACHER = np.array([[0.0, -0.5, -1.5, -1.0], [0.0, -2.0, -0.75, 0.0]])
OUTCOME = np.array([[0.0, 1.0, 1.0, 1.0], [0.0, -1.0, -1.0, 0.0]])


def reference_advantages(teacher, old, outcome, mask, weights, teacher_coef, outcome_coef):
    out = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                out[b, t] = outcome_coef * outcome[b, t]
                if weights[b]:
                    out[b, t] += teacher_coef * weights[b] * (teacher[b, t] - old[b, t])
    return out


@pytest.mark.parametrize("weights", [[1.0, 1.0], [1.0, 0.0], [3.0, 0.5]])
def test_token_advantage_is_the_weighted_teacher_log_ratio_plus_alpha_outcome(weights):
    """weights: each row's teacher weight w_i (0: no teacher)."""
    got = distill_advantages(TEACHER, OLD, OUTCOME, MASK, np.array(weights), 0.5, 2.0)
    want = reference_advantages(TEACHER, OLD, OUTCOME, MASK, weights, 0.5, 2.0)
    np.testing.assert_allclose(got, want, atol=1e-6)
    # by hand, row 0 token 1: 0.5 * w * (-0.5 - -1.0) + 2 * 1 = 0.25 w + 2
    assert got[0, 1] == pytest.approx(0.25 * weights[0] + 2)
    # row 1 token 2: 0.5 * w * (-0.75 - -3.0) + 2 * -1 = 1.125 w - 2 (a row without a teacher
    # keeps only alpha * A)
    assert got[1, 2] == pytest.approx(1.125 * weights[1] - 2.0)


def test_full_vocab_signal_leaves_only_the_outcome_term_in_the_advantage():
    got = distill_advantages(TEACHER, OLD, OUTCOME, MASK, np.array([1.0, 2.0]), 0.5, 2.0,
                             signal="full_vocab")
    np.testing.assert_allclose(got, 2.0 * OUTCOME * MASK)


# --------------------------------------------------------------------------------------------
# MOPD, eqs. 7-8

def reference_mopd(logp, infer, adv, mask, bounds):
    """-(1/G) sum_i (1/|y_i|) sum_t w_t A_t logp_t, w_t = pi/mu inside the closed bounds, and
    d/d logp_t (w_t a constant)."""
    loss, grad, responses = 0.0, np.zeros(mask.shape), 0
    for b in range(mask.shape[0]):
        tokens = [t for t in range(mask.shape[1]) if mask[b, t]]
        if not tokens:
            continue
        responses += 1
        for t in tokens:
            ratio = math.exp(logp[b, t] - infer[b, t])
            w = ratio if bounds[0] <= ratio <= bounds[1] else 0.0
            loss -= w * adv[b, t] * logp[b, t] / len(tokens)
            grad[b, t] = -w * adv[b, t] / len(tokens)
    return loss / responses, grad / responses


# log(pi/mu) per token: row 0: 0 (ratio 1, on the closed lower bound), log 1.9 (kept),
# log 2.1 (dropped); row 1: log 1.5 (kept), log 0.9 (dropped, below 1.0).
LOG_RATIO = np.array([[0.0, 0.0, math.log(1.9), math.log(2.1)],
                      [0.0, math.log(1.5), math.log(0.9), 0.0]])
LOGP = np.array([[0.0, -1.2, -0.7, -2.3], [0.0, -0.4, -1.6, 0.0]])
ADV = np.array([[0.0, 0.5, -1.5, 2.0], [0.0, 1.25, 3.0, 0.0]])
BOUNDS = (1.0, 2.0)


def f32(x):
    return jnp.asarray(np.asarray(x, np.float64), jnp.float32)


def test_mopd_loss_and_gradient_match_the_float64_loop():
    infer = LOGP - LOG_RATIO
    loss_fn = jax.jit(lambda logp: losses.mopd_loss(logp, f32(infer), f32(ADV), f32(MASK),
                                                    BOUNDS))
    (loss, stats), grad = loss_fn(f32(LOGP)), jax.grad(lambda l: loss_fn(l)[0])(f32(LOGP))
    want_loss, want_grad = reference_mopd(LOGP, infer, ADV, MASK, BOUNDS)
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(grad, want_grad, atol=1e-6)
    # kept: (0,1) (0,2) (1,1) of 5 tokens; dropped tokens get exactly no gradient
    assert float(stats["w_kept_frac"]) == pytest.approx(3 / 5)
    assert grad[0, 3] == 0 and grad[1, 2] == 0
    assert float(stats["w_mean"]) == pytest.approx((1.0 + 1.9 + 1.5) / 5, rel=1e-5)
    # by hand: row 0: -(1 * 0.5 * -1.2 + 1.9 * -1.5 * -0.7) / 3; row 1: -(1.5 * 1.25 * -0.4) / 2
    by_hand = (-(-0.6 + 1.995) / 3 - (-0.75) / 2) / 2
    assert float(loss) == pytest.approx(by_hand, rel=1e-5)


def test_kept_weight_fraction_counts_closed_bounds_over_response_tokens():
    infer = LOGP - LOG_RATIO
    assert kept_weight_fraction(LOGP, infer, MASK, BOUNDS) == pytest.approx(3 / 5)
    assert kept_weight_fraction(LOGP, infer, MASK, (0.5, 2.2)) == 1.0


def test_actor_loss_runs_mopd_with_its_bounds_and_adds_the_full_vocab_kl():
    rl = RLConfig(algorithm="mopd", kl_coef=0.0,
                  distill=DistillConfig(teacher_coef=0.25, ratio_bounds=BOUNDS))
    assert rl.aggregation == "sequence_mean" and not rl.uses_critic
    infer = LOGP - LOG_RATIO
    kl = np.array([[9.0, 0.5, 0.25, 1.0], [9.0, 2.0, 4.0, 9.0]])  # 9: off the mask
    mb = {"infer_logp": f32(infer), "advantages": f32(ADV), "mask": f32(MASK),
          "select": f32(MASK), "old_logp": f32(LOGP), "ref_logp": f32(LOGP),
          "teacher_id": jnp.asarray([1, -1], jnp.int32),
          "teacher_weight": jnp.asarray([3.0, 0.0], jnp.float32)}
    loss, stats = actor_loss(rl, f32(LOGP), mb)
    want, _ = reference_mopd(LOGP, infer, ADV, MASK, BOUNDS)
    assert float(loss) == pytest.approx(want, rel=1e-5)
    with_kl, stats = actor_loss(rl, f32(LOGP), mb, f32(kl))
    # only row 0 has a teacher, of weight w = 3; sequence mean over both responses:
    # 0.25 * 3 * (0.5+0.25+1)/3 / 2
    assert float(with_kl) == pytest.approx(want + 0.25 * 3 * (1.75 / 3) / 2, rel=1e-5)
    assert float(stats["teacher_kl"]) == pytest.approx(1.75 / 3, rel=1e-6)


# --------------------------------------------------------------------------------------------
# metrics and the full-vocabulary KL

def test_teacher_metrics_per_task_are_means_over_its_response_tokens():
    tasks = np.array(["add", "sub"])
    got = teacher_metrics(TEACHER, OLD, MASK, tasks, ["add", "sub"])
    for b, name in enumerate(tasks):
        tokens = [t for t in range(4) if MASK[b, t]]
        assert got[f"distill/kl/{name}"] == pytest.approx(
            sum(OLD[b, t] - TEACHER[b, t] for t in tokens) / len(tokens))
        assert got[f"distill/teacher_logp/{name}"] == pytest.approx(
            sum(TEACHER[b, t] for t in tokens) / len(tokens))
    # pooled over the 5 taught tokens: (-0.5 + 1.0 - 1.0 + 1.75 - 2.25) / 5
    assert got["distill/kl"] == pytest.approx(-1.0 / 5)
    only_add = teacher_metrics(TEACHER, OLD, MASK, tasks, ["add"])
    assert "distill/kl/sub" not in only_add
    assert only_add["distill/kl"] == only_add["distill/kl/add"]


def test_reverse_kl_over_the_student_vocabulary_matches_numpy():
    rng = np.random.default_rng(0)
    student = rng.normal(size=(3, 5, 6))
    teacher = rng.normal(size=(3, 5, 9))  # a larger teacher vocabulary, same first 6 ids
    log_s = student - np.log(np.exp(student).sum(-1, keepdims=True))
    log_t = teacher - np.log(np.exp(teacher).sum(-1, keepdims=True))
    want = np.zeros((3, 5))
    for i in range(3):
        for j in range(5):
            want[i, j] = sum(math.exp(log_s[i, j, v]) * (log_s[i, j, v] - log_t[i, j, v])
                             for v in range(6))
    np.testing.assert_allclose(reverse_kl(f32(log_s), f32(log_t)), want, atol=1e-5)
    # the same teacher distribution cut to 6 ids equals the student's: KL exactly 0
    np.testing.assert_allclose(reverse_kl(f32(log_s), f32(np.concatenate(
        [log_s, np.full((3, 5, 3), -50.0)], -1))), 0.0, atol=1e-5)


# --------------------------------------------------------------------------------------------
# config

@pytest.mark.parametrize("make, message", [
    (lambda: DistillConfig(signal="logits"), "rl.distill.signal: got 'logits', allowed values "
                                             "are ['token', 'full_vocab']"),
    (lambda: DistillConfig(teacher_coef=-1), "rl.distill.teacher_coef: must be a number >= 0"),
    (lambda: DistillConfig(outcome_coef="a"), "rl.distill.outcome_coef: must be a number >= 0"),
    (lambda: DistillConfig(ratio_bounds=(1.5, 2.0)), "rl.distill.ratio_bounds: need two "
                                                     "numbers 0 < eps_low <= 1 <= eps_high"),
    (lambda: task_config_from_dict({"tasks": {"add": {"kind": "arithmetic",
                                                      "teacher": {"checkpoint": 3}}}}),
     "task.tasks.add.teacher.checkpoint: must be a path (a string), got 3"),
    (lambda: task_config_from_dict({"tasks": {"add": {"kind": "arithmetic",
                                                      "teacher": {"weight": -1}}}}),
     "task.tasks.add.teacher.weight: must be a number >= 0, got -1"),
    (lambda: rl_config_from_dict({"rl": {"algorithm": "mopd"}, "task": {"max_operand": 9}}),
     "rl.distill.teacher.checkpoint: rl.algorithm=mopd needs a teacher"),
])
def test_bad_distill_config_names_the_field(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value).startswith(message), str(info.value)


def test_a_task_teacher_wins_over_the_run_wide_one():
    mix = task_config_from_dict({"tasks": {"add": {"kind": "arithmetic",
                                                   "teacher": {"checkpoint": "runs/a"}},
                                           "sub": {"kind": "arithmetic"}}})
    assert task_teachers(DistillConfig(), mix.tasks) == {
        "add": (TeacherConfig("runs/a"), "task.tasks.add.teacher")}
    wide = DistillConfig(teacher=TeacherConfig("runs/w", "arith_chars"))
    assert task_teachers(wide, mix.tasks) == {
        "add": (TeacherConfig("runs/a"), "task.tasks.add.teacher"),
        "sub": (TeacherConfig("runs/w", "arith_chars"), "rl.distill.teacher")}


def test_shipped_mopd_experiment_configs_load():
    """configs/rl_mopd_arith.yaml, its baseline and its two teachers (`make mopd`)."""
    configs = Path(__file__).resolve().parents[2] / "configs"
    mopd = load_rl_config(configs / "rl_mopd_arith.yaml")
    assert mopd.rl.algorithm == "mopd" and mopd.rl.aggregation == "sequence_mean"
    assert mopd.rl.distill == DistillConfig()  # the documented defaults, written out
    teachers = task_teachers(mopd.rl.distill, mopd.task.tasks)
    assert {task: t.checkpoint for task, (t, _) in teachers.items()} == {
        "add": "runs/mopd/teacher_add", "sub": "runs/mopd/teacher_sub"}
    mixed = load_rl_config(configs / "rl_mixed_arith.yaml")
    assert (mixed.rl.algorithm, mixed.rl.distill.teacher_coef) == ("ppo", 0.0)
    assert [t.name for t in mixed.task.tasks] == [t.name for t in mopd.task.tasks]
    for name, ops in (("add", "+"), ("sub", "-")):
        [task] = load_rl_config(configs / f"rl_teacher_{name}.yaml").task.tasks
        assert (task.name, task.ops, task.teacher.checkpoint) == (name, ops, "")
