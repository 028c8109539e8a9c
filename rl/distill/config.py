"""Configuration of on-policy distillation: a teacher (`TeacherConfig`), named per task or run
wide, and the weights of the signal (`DistillConfig`, the `rl.distill` section).

    rl:
      algorithm: mopd                    # or mis_po / ppo with a teacher term in the advantage
      distill: {teacher_coef: 1.0, outcome_coef: 1.0, ratio_bounds: [0.5, 2.0], signal: token}
    task:
      tasks:
        add: {ops: "+", teacher: {checkpoint: runs/mopd/teacher_add}}
        sub: {ops: "-", teacher: {checkpoint: runs/mopd/teacher_sub}}

A task's teacher is its own `teacher:` if it names a checkpoint, else `rl.distill.teacher` (one
teacher for every task: plain OPD), else none: that task's rows get only the outcome term.
Each teacher's `weight` is DeepSeek-V4's w_i (eq. 29, sum_i w_i KL(pi_theta || pi_E_i)): its
rows' teacher term is multiplied by it, with either signal; V4 gives no values ("usually
determined by relative importance"), 1 is the default.
"""

from __future__ import annotations

import dataclasses

from model.config import Config, ConfigError, check_choice, check_nonnegative

SIGNALS = ("token", "full_vocab")
# MiMo-V2-Flash's MOPD (eqs. 7-9) gives no values for eps_low, eps_high and alpha; these are the
# placeholders of its reference snippet, and the bounds equal MIS-PO's token bounds (report
# 5.2.3), the same kind of train-inference ratio filter.
RATIO_BOUNDS = (0.5, 2.0)
OUTCOME_COEF = 1.0


@dataclasses.dataclass(frozen=True)
class TeacherConfig(Config):
    """A frozen teacher: any checkpoint `model.weights.load_model` reads (stepjax model
    directory, HF checkpoint, `python -m train` or `python -m rl` workdir), possibly of another
    architecture family, with the student's vocabulary."""

    checkpoint: str = ""  # "" = no teacher here
    tokenizer: str = ""  # "" = the checkpoint's own (tokenizer.json or the workdir's)
    weight: float = 1.0  # w_i of V4's eq. 29: scales this teacher's term on its rows

    def validate(self) -> None:
        for name in ("checkpoint", "tokenizer"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(name, f"must be a path (a string), got {getattr(self, name)!r}")
        check_nonnegative("weight", self.weight)


@dataclasses.dataclass(frozen=True)
class DistillConfig(Config):
    """`rl.distill`: how teacher log-probs enter the student's update (rl/distill/signal.py).

    signal `token`: the advantage of response token t is
        teacher_coef * w_i * (log pi_teacher(y_t) - log pi_old(y_t)) + outcome_coef * A_outcome,t
    (MiMo MOPD eqs. 8-9 with teacher_coef = w_i = 1 and outcome_coef = alpha), for every
    algorithm; w_i is the row's teacher's `weight`. signal `full_vocab`: the advantage is
    outcome_coef * A_outcome and the actor loss adds teacher_coef * w_i * KL(pi_theta ||
    pi_teacher) over the whole vocabulary at every response position (DeepSeek-V4's OPD,
    eq. 29). `ratio_bounds` are MOPD's [eps_low, eps_high] on
    w_t = pi_theta / mu_theta (eq. 8), used by `rl.algorithm=mopd` only."""

    section = "rl.distill"

    teacher: TeacherConfig = TeacherConfig()  # the default of every task without its own
    signal: str = "token"  # token | full_vocab
    teacher_coef: float = 1.0
    outcome_coef: float = OUTCOME_COEF  # alpha of eq. 9
    ratio_bounds: tuple = RATIO_BOUNDS

    def validate(self) -> None:
        check_choice("signal", self.signal, SIGNALS)
        check_nonnegative("teacher_coef", self.teacher_coef)
        check_nonnegative("outcome_coef", self.outcome_coef)
        bounds = self.ratio_bounds
        if (not isinstance(bounds, (tuple, list)) or len(bounds) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool)
                           for b in bounds)
                or not 0 < bounds[0] <= 1 <= bounds[1]):
            raise ConfigError("ratio_bounds", f"need two numbers 0 < eps_low <= 1 <= eps_high, "
                              f"got {bounds!r}")


def task_teachers(distill: DistillConfig, tasks) -> dict[str, tuple[TeacherConfig, str]]:
    """{task name: (its teacher, the config field that names it)} for the tasks (TaskConfig)
    that have one (module docstring)."""
    out = {}
    for task in tasks:
        if task.teacher.checkpoint:
            out[task.name] = (task.teacher, f"task.tasks.{task.name}.teacher")
        elif distill.teacher.checkpoint:
            out[task.name] = (distill.teacher, "rl.distill.teacher")
    return out
