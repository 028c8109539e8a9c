"""The full-vocabulary reverse KL of DeepSeek-V4's on-policy distillation (its eq. 29,
sum_i w_i KL(pi_theta || pi_E_i), which V4 prefers to the token-level estimator as lower in
variance): at every response position, sum_v pi_theta(v) (log pi_theta(v) - log pi_E(v)).

As V4 does, only the teachers' final (normed) hidden states are kept per iteration, [B, T, D_t]
(rl/distill/teachers.py); their logits are rebuilt through each teacher's output head inside the
actor step, a chunk of positions at a time together with the student's (rl/models.py:
`token_logprobs(..., teacher=...)`), so no [B, T, V] array of either model exists. Gradients flow
through the student's log-probabilities only; the teachers' are constants.

A teacher's vocabulary may be larger than the student's (same tokenizer, rounded up further):
its log-softmax is over its own V_t and the KL sums over the student's V_s ids, where all of the
student's mass is (rl/distill/teachers.py refuses a smaller one).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.lm import CausalLM, output_head_params


def reverse_kl(student_log_probs, teacher_log_probs):
    """KL(student || teacher) per position: [..., V_s], [..., V_t >= V_s] log-probabilities ->
    [...]. The teacher's ids past V_s carry no student mass and drop out."""
    teacher = teacher_log_probs[..., :student_log_probs.shape[-1]]
    return jnp.sum(jnp.exp(student_log_probs) * (student_log_probs - teacher), axis=-1)


def head_params(config: ModelConfig, variables: dict) -> dict:
    """The part of a teacher's variables its output head reads (what the actor step gets)."""
    return output_head_params(config, variables["params"])


def teacher_log_probs_fn(configs: Sequence[ModelConfig], heads: Sequence[dict], vocab: int,
                         temperature: float) -> Callable:
    """-> fn(hidden [n, D_max], teacher_id [n]) -> float32 [n, vocab]: each position's
    log-softmax (at `temperature`) of the logits its teacher's head (`heads[teacher_id]`, of
    `configs[teacher_id]`, reading the first D of the padded hidden state) gives, cut to the
    student's `vocab` ids; 0 where teacher_id is -1 (no teacher)."""
    def fn(hidden, teacher_id):
        out = jnp.zeros((hidden.shape[0], vocab), jnp.float32)
        for index, (config, head) in enumerate(zip(configs, heads)):
            logits = CausalLM(config).apply({"params": head}, hidden[:, :config.d_model],
                                            method=CausalLM.project) / temperature
            log_probs = jax.nn.log_softmax(logits, axis=-1)[:, :vocab]
            out = jnp.where((teacher_id == index)[:, None], log_probs, out)
        return out

    return fn
