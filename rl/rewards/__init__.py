"""Rewards (report 5.2.2) behind one interface, `Reward.score(problems, responses) -> float32
[n]`: rule verifiers (`verifiers.py`: the arithmetic and multi-step tasks' strict grammars) and a
generative pairwise judge (`judge.py`, its prompt `template.py`) whose confidences become
Bradley-Terry rewards (`bradley_terry.py`)."""

from rl.rewards.bradley_terry import bradley_terry_reward
from rl.rewards.interface import Reward
from rl.rewards.verifiers import (
    RuleVerifier,
    arithmetic_reward,
    arithmetic_rewards,
    final_answer,
    multistep_reward,
    multistep_rewards,
    parse_integer,
)

__all__ = ["Reward", "RuleVerifier", "arithmetic_reward", "arithmetic_rewards",
           "bradley_terry_reward", "final_answer", "multistep_reward", "multistep_rewards",
           "parse_integer"]
