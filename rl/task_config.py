"""The `task:` section of an RL run: the tasks mixed into every batch, each with its reward.

    task:                                  # a weighted mix (configs/rl_arith_mix.yaml)
      heldout_fraction: 0.05
      tasks:
        arithmetic: {weight: 0.5, max_operand: 99}
        multistep: {weight: 0.5, max_operand: 20}

    task: {name: arithmetic, max_operand: 99, ops: "+-"}     # one task, written inline

A task's key is its name (metrics `reward/<name>`, `accuracy/<name>`, `eval/accuracy/<name>`)
and, unless `kind` says otherwise, its kind: `arithmetic` (`a op b`, train/data/arithmetic.py) or
`multistep` (`a op b op c` with a worked line, train/data/multistep.py). Its reward is the kind's
rule `verifier` or a generative pairwise `judge` (report 5.2.2) with its `judge:` fields. Its
`teacher:` (a checkpoint) is the task's teacher in on-policy distillation (rl/distill/).
`heldout_fraction` holds out problems of every task by hash, as the SFT corpus does.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from model.config import (
    Config,
    ConfigError,
    build_dataclass,
    check_choice,
    check_int,
    check_nonnegative,
    check_open_fraction,
    check_positive,
)
from rl.distill.config import TeacherConfig
from rl.rewards.template import DEFAULT_CHOICES, DEFAULT_TEMPLATE, template_error
from train.data import arithmetic, multistep

REWARDS = ("verifier", "judge")
TASK_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class TaskKind:
    """What a kind of task allows, and its defaults."""

    ops: str  # the operators it allows
    default_ops: str
    default_max_operand: int
    max_operand_limit: int  # its problems are enumerated: the space is bounded


KINDS = {
    "arithmetic": TaskKind("".join(arithmetic.OPERATORS), "+-", 99, arithmetic.OPERAND_LIMIT),
    "multistep": TaskKind(multistep.OPS, multistep.OPS, multistep.DEFAULT_MAX_OPERAND,
                          multistep.OPERAND_LIMIT),
}


@dataclasses.dataclass(frozen=True)
class JudgeConfig(Config):
    """A generative pairwise judge (rl/rewards/judge.py): a checkpoint compares each response
    with the problem's reference solution, in both orders; Bradley-Terry reward (report 5.2.2)."""

    checkpoint: str = ""  # stepjax model directory, HF checkpoint or `python -m train` workdir
    tokenizer: str = ""  # "" = the checkpoint's tokenizer.json or the workdir's recorded one
    template: str = DEFAULT_TEMPLATE  # with {question}, {response_a}, {response_b}
    choices: tuple = DEFAULT_CHOICES  # the next tokens meaning "A wins" and "B wins"
    length_penalty: float = 0.0  # logits per unit of relative excess length over the reference
    batch_size: int = 32  # judge prompts per forward pass

    def validate(self) -> None:
        for name in ("checkpoint", "tokenizer"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(name, f"must be a path (a string), got {getattr(self, name)!r}")
        problem = template_error(self.template)
        if problem:
            raise ConfigError("template", problem)
        if (not isinstance(self.choices, tuple) or len(self.choices) != 2
                or not all(isinstance(c, str) and c for c in self.choices)
                or self.choices[0] == self.choices[1]):
            raise ConfigError("choices", f"expected two different non-empty strings, got "
                              f"{self.choices!r}")
        check_nonnegative("length_penalty", self.length_penalty)
        check_int("batch_size", self.batch_size, 1)


@dataclasses.dataclass(frozen=True)
class TaskConfig(Config):
    """One task of the mix; its place in the YAML names its fields (`task.tasks.<name>.`, or
    `task.` for a task written inline)."""

    name: str = "arithmetic"
    kind: str = "arithmetic"  # arithmetic | multistep
    weight: float = 1.0  # share of each batch's prompts (normalised over the tasks)
    max_operand: int = 99  # operands in [0, max_operand]
    ops: str = "+-"
    reward: str = "verifier"  # verifier | judge
    judge: JudgeConfig = JudgeConfig()
    teacher: TeacherConfig = TeacherConfig()  # on-policy distillation (rl/distill/config.py)

    def validate(self) -> None:
        if not isinstance(self.name, str) or not TASK_NAME.fullmatch(self.name):
            raise ConfigError("name", f"must be lowercase letters, digits and _ (it names "
                              f"metrics), got {self.name!r}")
        check_choice("kind", self.kind, tuple(KINDS))
        kind = KINDS[self.kind]
        check_positive("weight", self.weight)
        check_int("max_operand", self.max_operand, 1)
        if self.max_operand > kind.max_operand_limit:
            raise ConfigError("max_operand", f"must be <= {kind.max_operand_limit} for {self.kind} "
                              f"(its problems are enumerated), got {self.max_operand}")
        if not isinstance(self.ops, str) or not self.ops or set(self.ops) - set(kind.ops):
            raise ConfigError("ops", f"must be a non-empty string of {' '.join(kind.ops)}, got "
                              f"{self.ops!r}")
        check_choice("reward", self.reward, REWARDS)
        if self.reward == "judge" and not self.judge.checkpoint:
            raise ConfigError("judge.checkpoint", "required with reward: judge (a stepjax model "
                              "directory, HF checkpoint or training workdir)")


@dataclasses.dataclass(frozen=True)
class TaskMixConfig(Config):
    """The `task:` section: the tasks and the held-out fraction they share."""

    section = "task"

    tasks: tuple = (TaskConfig(),)
    heldout_fraction: float = 0.05  # by hash, the same split as the SFT corpus

    def validate(self) -> None:
        if not self.tasks or not all(isinstance(t, TaskConfig) for t in self.tasks):
            raise ConfigError("tasks", "expected at least one task")
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ConfigError("tasks", f"task names must be unique, got {names}")
        check_open_fraction("heldout_fraction", self.heldout_fraction)

    @property
    def weights(self) -> list[float]:
        return [t.weight for t in self.tasks]

    def to_dict(self) -> dict:
        """The mix form (a task written inline reads back as a one-task mix)."""
        return {"heldout_fraction": self.heldout_fraction,
                "tasks": {t.name: {k: v for k, v in dataclasses.asdict(t).items() if k != "name"}
                          for t in self.tasks}}


def task_config_from_dict(values: Mapping[str, Any] | None) -> TaskMixConfig:
    """The `task:` section -> TaskMixConfig: a `tasks:` mix, or one task written inline (the form
    of runs saved before the mix existed, which therefore resume)."""
    values = dict(values or {})
    fraction = values.pop("heldout_fraction", TaskMixConfig.heldout_fraction)
    if "tasks" not in values:
        name = values.pop("name", "arithmetic")
        if "kind" not in values and name not in KINDS:
            raise ConfigError("name", f"got {name!r}, allowed values are {list(KINDS)} (or give "
                              "the task a kind)").within("task")
        return TaskMixConfig(tasks=(_task(name, values, "task."),), heldout_fraction=fraction)
    tasks = values.pop("tasks")
    if values:
        key = sorted(values)[0]
        raise ValueError(f"task.{key}: with task.tasks it belongs to a task "
                         f"(task.tasks.<name>.{key}); next to tasks only heldout_fraction")
    if not isinstance(tasks, Mapping) or not tasks:
        raise ValueError("task.tasks: expected a mapping of task names to tasks, e.g. "
                         "{arithmetic: {weight: 0.5}, multistep: {weight: 0.5}}")
    return TaskMixConfig(tasks=tuple(_task(str(name), spec, f"task.tasks.{name}.")
                                     for name, spec in tasks.items()),
                         heldout_fraction=fraction)


def _task(name: str, values: Mapping[str, Any] | None, prefix: str) -> TaskConfig:
    """One task: the kind's defaults, then the given fields (`prefix` names them in errors)."""
    values = {} if values is None else values
    if not isinstance(values, Mapping):
        raise ValueError(f"{prefix.rstrip('.')}: expected a mapping of task fields, got "
                         f"{values!r}")
    if "name" in values:
        raise ValueError(f"{prefix}name: a task of task.tasks is named by its key")
    kind = KINDS.get(values.get("kind", name))
    defaults = {"max_operand": kind.default_max_operand, "ops": kind.default_ops} if kind else {}
    return build_dataclass(TaskConfig, {"name": name, "kind": values.get("kind", name),
                                        **defaults, **values}, prefix)
