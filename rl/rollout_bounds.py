"""The bounds of an RL run's rollout settings, checked when its config is built (rl/config.py):
how the policy is sampled (`rl.temperature`, `rl.top_p`) and how old a trained batch may be
(`rl.max_staleness`, rl/staleness.py). Errors name the field within `rl`."""

from __future__ import annotations

from model.config import ConfigError, check_int
from model.inference.sampling import Sampling

# RL samples its policy: below this, sampling is practically greedy, and the log-probabilities
# of logits / T that the bfloat16 rollouts and the float32 training compute may differ beyond
# float32's exp() range (importance ratios of inf).
MIN_TEMPERATURE = 0.01


def check_sampling(temperature: float, top_p: float) -> None:
    Sampling(temperature, top_p=top_p).validate()  # finite numbers, top_p in (0, 1]
    if temperature < MIN_TEMPERATURE:
        raise ConfigError("temperature", f"must be at least {MIN_TEMPERATURE}, got {temperature}: "
                          "RL samples its policy, and below that sampling is practically greedy "
                          "while the rollouts' and the training's log-probabilities of "
                          "logits / T may differ beyond float32's range")


def check_staleness(max_staleness: int, iterations: int) -> None:
    """k waiting batches are held (in the RL state, so in memory and in every checkpoint): at
    most one per iteration of the run. k >= iterations - 1 already trains every batch on the
    initial policy's rollouts."""
    check_int("max_staleness", max_staleness, 0)
    if max_staleness > iterations:
        raise ConfigError("max_staleness", f"{max_staleness} exceeds rl.iterations={iterations}: "
                          "a batch cannot wait longer than the run lasts, and each waiting batch "
                          f"is held in memory; lower it ({max(iterations - 1, 0)} already trains "
                          "every batch on the initial policy's rollouts)")
