"""The token-level distillation signal and its metrics: pure functions of [B, T] arrays in token
space (entry t concerns response token t, rl/models.py), `mask` 1 on response tokens.

The teacher term of MiMo-V2-Flash's MOPD (eqs. 5-9) is the per-token advantage
sg[log pi_teacher(y_t) - log pi_theta(y_t)]: minimising eq. 5 is minimising the reverse KL
E_{pi_theta} log(pi_theta / pi_teacher), and its gradient (eq. 6) is a policy gradient with that
log-ratio as the advantage. Here it is formed ONCE per iteration with pi_theta = pi_old, the
pre-update student recomputed by the training path: the stop-gradient makes it a constant, and
over one epoch of minibatches it stays the value at the epoch's start (as every advantage of the
loop does). Eq. 9 adds the outcome advantage times alpha (`rl.distill.outcome_coef`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def distill_advantages(teacher_logp, old_logp, outcome_advantages, mask, teacher_weights,
                       teacher_coef: float, outcome_coef: float, signal: str = "token"):
    """-> advantages [B, T] (numpy float32) on the response tokens:
    teacher_coef * w * (log pi_teacher - log pi_old), w = each row's teacher weight
    (`teacher_weights` [B], V4's w_i; 0 on rows without a teacher), plus outcome_coef *
    `outcome_advantages` (eq. 9) on every row. With the
    `full_vocab` signal the teacher term is the loss's KL instead (rl/distill/full_vocab.py) and
    only the outcome term remains here."""
    mask = np.asarray(mask, np.float32)
    out = outcome_coef * np.asarray(outcome_advantages, np.float32) * mask
    if signal == "token":
        log_ratio = np.asarray(teacher_logp, np.float32) - np.asarray(old_logp, np.float32)
        weights = np.asarray(teacher_weights, np.float32)[:, None]
        out = out + teacher_coef * log_ratio * mask * weights
    return out.astype(np.float32)


def kept_weight_fraction(logp, infer_logp, mask, ratio_bounds) -> float:
    """The fraction of response tokens whose MOPD weight w_t is kept (eq. 8: eps_low <=
    pi / mu <= eps_high, closed), at pi = `logp`."""
    mask = np.asarray(mask, np.float64)
    ratio = np.exp(np.where(mask > 0, np.asarray(logp, np.float64) - infer_logp, 0.0))
    keep = (ratio >= ratio_bounds[0]) & (ratio <= ratio_bounds[1])
    return float((keep * mask).sum() / max(mask.sum(), 1.0))


def teacher_metrics(teacher_logp, old_logp, mask, tasks: np.ndarray, names: Sequence[str]
                    ) -> dict[str, float]:
    """Per task with a teacher (`names`; `tasks` str [B] each row's task), over its response
    tokens: `distill/kl/<task>`, the sampled-token estimate of KL(pi_old || pi_teacher), the
    mean of log pi_old - log pi_teacher; `distill/teacher_logp/<task>`, the mean teacher
    log-prob of the student's tokens; and `distill/kl` over every taught row."""
    mask = np.asarray(mask, np.float64)
    teacher, old = np.asarray(teacher_logp, np.float64), np.asarray(old_logp, np.float64)
    out = {}
    taught = np.zeros(len(tasks), bool)
    for name in names:
        rows = tasks == name
        if not rows.any():
            continue
        taught |= rows
        weights = mask * rows[:, None]
        count = max(weights.sum(), 1.0)
        out[f"distill/kl/{name}"] = float(((old - teacher) * weights).sum() / count)
        out[f"distill/teacher_logp/{name}"] = float((teacher * weights).sum() / count)
    weights = mask * taught[:, None]
    out["distill/kl"] = float(((old - teacher) * weights).sum() / max(weights.sum(), 1.0))
    return out
