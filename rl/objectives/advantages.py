"""Returns and advantages from terminal rewards: truncation-aware bootstrapping (report 5.2.1,
eq. 3) and GAE (gamma = lambda = 1 by default, following ORZ as report 5.2.3 does).

Arrays are [B, T] over token positions; a response occupies the positions where `mask` is 1
(contiguous). `values[b, t]` = V(s_t), the critic's estimate before response token t is sampled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def bootstrapped_rewards(rewards, truncated, final_values):
    """Eq. 3: a truncated response (cut by the length limit, not finished) gets V(s_T), the
    critic's value of its final state, instead of its reward. rewards, truncated,
    final_values: [B] -> [B]."""
    return jnp.where(truncated, final_values, rewards)


def terminal_rewards(rewards, mask):
    """Places each row's reward on its last response token: [B], [B, T] -> [B, T]."""
    mask = mask.astype(jnp.float32)
    index = jnp.arange(mask.shape[1])
    last = jnp.max(jnp.where(mask > 0, index, -1), axis=1)
    return jnp.where(index == last[:, None], rewards[:, None], 0.0) * mask


def gae(token_rewards, values, mask, gamma: float = 1.0, lam: float = 1.0):
    """Generalised advantage estimation over the response tokens -> (advantages, returns),
    both [B, T], zero off the mask. delta_t = r_t + gamma V(s_{t+1}) - V(s_t), with V = 0 after
    the last response token (the episode ends there; a truncation is folded into r by eq. 3);
    A_t = delta_t + gamma lambda A_{t+1}; returns = A + V are the critic's targets."""
    mask = mask.astype(jnp.float32)
    values = values * mask
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    next_values = next_values * jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], 1)
    deltas = (token_rewards + gamma * next_values - values) * mask

    def step(carry, xs):
        delta, m = xs
        advantage = delta + gamma * lam * carry * m
        return advantage * m, advantage * m

    _, advantages = jax.lax.scan(step, jnp.zeros(mask.shape[0]), (deltas.T, mask.T),
                                 reverse=True)
    advantages = advantages.T
    return advantages, (advantages + values) * mask
