"""What on-policy distillation adds to an RL iteration (`RLTrainer.iteration`, rl/trainer.py):

    distillation = Distillation.of_run(run, tokenizer, mesh)     # None: no task has a teacher
    advantages, extra, metrics = distillation.apply(drawn, old_logp, outcome_advantages)

The student samples (the ordinary rollouts); each row's task teacher scores its tokens
(rl/distill/teachers.py); the teacher term joins the advantage (`token` signal,
rl/distill/signal.py) or, with the `full_vocab` signal, the actor loss (rl/distill/full_vocab.py,
fed by `extra`: the teachers' hidden states and each row's teacher). The update itself is the
configured algorithm's, with its own train-inference mismatch handling: MIS-PO's filters, PPO's
clipped ratio, MOPD's truncated weight w_t (eq. 8).
"""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

from model.tokenizers.text import TextTokenizer
from rl.config import RLRunConfig
from rl.distill.config import task_teachers
from rl.distill.full_vocab import head_params
from rl.distill.signal import distill_advantages, kept_weight_fraction, teacher_metrics
from rl.distill.teachers import load_teachers, score_rows
from rl.draw import Draw


class Distillation:
    """The teachers of one run (loaded once) and the distillation step of each iteration."""

    def __init__(self, run: RLRunConfig, tokenizer: TextTokenizer, mesh: Mesh):
        self.rl, self.mesh = run.rl, mesh
        assigned = task_teachers(run.rl.distill, run.task.tasks)
        self.teachers = load_teachers(assigned, tokenizer, run.model.vocab_size, mesh)
        # w_i of V4's eq. 29, per task: tasks sharing a checkpoint may weigh it differently.
        self.task_weights = {task: teacher.weight for task, (teacher, _) in assigned.items()}
        self.full_vocab = run.rl.distill.signal == "full_vocab"
        # What the actor step needs for the full-vocabulary KL: each teacher's architecture and
        # output head, in the order of `TeacherScores.teacher_id`.
        self.head_configs = tuple(t.config for t in self.teachers) if self.full_vocab else ()
        self.heads = (tuple(head_params(t.config, t.variables) for t in self.teachers)
                      if self.full_vocab else ())

    @classmethod
    def of_run(cls, run: RLRunConfig, tokenizer: TextTokenizer, mesh: Mesh
               ) -> "Distillation | None":
        """The run's distillation, or None when no task has a teacher."""
        if not task_teachers(run.rl.distill, run.task.tasks):
            return None
        return cls(run, tokenizer, mesh)

    def apply(self, drawn: Draw, old_logp, outcome_advantages
              ) -> tuple[np.ndarray, dict, dict[str, float]]:
        """The iteration's rows scored by their teachers -> (advantages [B, T] with the teacher
        term, extra minibatch arrays (full_vocab: `teacher_hidden`, `teacher_id`,
        `teacher_weight`), metrics).
        `old_logp` [B, T]: pi_old, the student before this iteration's update."""
        rollouts, distill = drawn.rollouts, self.rl.distill
        old_logp = np.asarray(old_logp)
        scores = score_rows(self.teachers, drawn.tasks, rollouts.tokens, rollouts.segment_ids,
                            self.rl.temperature, self.mesh, with_hidden=self.full_vocab)
        weights = np.float32([self.task_weights.get(task, 0.0) for task in drawn.tasks])
        advantages = distill_advantages(scores.logp, old_logp, outcome_advantages,
                                        rollouts.mask, weights, distill.teacher_coef,
                                        distill.outcome_coef, distill.signal)
        names = [task for teacher in self.teachers for task in teacher.tasks]
        metrics = teacher_metrics(scores.logp, old_logp, rollouts.mask, drawn.tasks, names)
        if self.rl.algorithm == "mopd":  # w_t at pi_theta = pi_old: the first minibatch's
            metrics["distill/w_kept_frac"] = kept_weight_fraction(
                old_logp, rollouts.infer_logp, rollouts.mask, distill.ratio_bounds)
        extra = ({"teacher_hidden": scores.hidden, "teacher_id": scores.teacher_id,
                  "teacher_weight": weights} if self.full_vocab else {})
        return advantages, extra, metrics
