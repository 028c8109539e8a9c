"""The RL tasks of a run, built from the `task:` section (rl/task_config.py).

    tasks = build_tasks(run.task)         # [Task], in the config's order
    task.train, task.heldout              # problems (`.prompt`, `.answer`, `.solution`, `.key`)
    task.reward.score(problems, texts)    # the reward the policy is trained on (float32 [n])
    task.verifier.score(problems, texts)  # exact match (accuracy), whatever the reward

Each kind names its problems and its rule verifier; a task's reward is that verifier or a
generative pairwise judge (report 5.2.2). Every task's held-out problems are chosen by the hash
of their keys (`split_problems`), the split the SFT corpus uses for the same problems.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from model.config import ConfigError
from rl.rewards.interface import Reward
from rl.rewards.judge import PairwiseJudge
from rl.rewards.verifiers import RuleVerifier, arithmetic_rewards, multistep_rewards
from rl.task_config import TaskConfig, TaskMixConfig
from train.data.arithmetic import arithmetic_problems, split_problems
from train.data.multistep import multistep_problems

# kind -> (problems(max_operand, ops), batch rule verifier(responses, answers))
KINDS: dict[str, tuple[Callable, Callable]] = {
    "arithmetic": (arithmetic_problems, arithmetic_rewards),
    "multistep": (multistep_problems, multistep_rewards),
}


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    weight: float
    train: list
    heldout: list
    reward: Reward
    verifier: RuleVerifier


def build_tasks(mix: TaskMixConfig) -> list[Task]:
    """One `Task` per configured task (a judge's checkpoint is loaded here)."""
    return [build_task(config, mix.heldout_fraction) for config in mix.tasks]


def build_task(config: TaskConfig, heldout_fraction: float) -> Task:
    problems, rule = KINDS[config.kind]
    train, heldout = split_problems(problems(config.max_operand, config.ops), heldout_fraction)
    if not train or not heldout:
        raise ValueError(f"task.tasks.{config.name}: the train or held-out split is empty; "
                         "change task.heldout_fraction or the task's max_operand")
    verifier = RuleVerifier(rule)
    reward = verifier if config.reward == "verifier" else _judge(config)
    return Task(config.name, config.weight, train, heldout, reward, verifier)


def _judge(config: TaskConfig) -> PairwiseJudge:
    judge = config.judge
    try:
        return PairwiseJudge.from_checkpoint(
            judge.checkpoint, judge.tokenizer, template=judge.template, choices=judge.choices,
            length_penalty=judge.length_penalty, batch_size=judge.batch_size)
    except ConfigError as err:
        raise err.within(f"task.tasks.{config.name}.judge") from None
    except ValueError as err:  # load_model: not a checkpoint
        raise ConfigError("checkpoint", str(err)).within(f"task.tasks.{config.name}.judge") \
            from None
