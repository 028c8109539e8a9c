"""`train.eval_tasks` and `train.samples`: what a run evaluates besides its held-out loss
(train/periodic.py); fields of `TrainConfig` (train/config.py), which checks them against the
run's cadence and length."""

from __future__ import annotations

import dataclasses

from typing import Any

from model.config import Config, ConfigError, check_int


@dataclasses.dataclass(frozen=True)
class TaskEvalConfig(Config):
    """lm-evaluation-harness tasks run with every held-out evaluation (`train.eval_every`) on
    the first `limit` samples of each, logged as `eval/<task>/<metric>` (the `eval` extra).

    `tasks`: lm-eval task or group names (or YAML paths); `include_path`: a directory of task
    YAMLs; `num_fewshot`: -1 takes each task's own; `max_length`: the decoder's cache, the
    longest context (0: `train.seq_len`)."""

    section = "train.eval_tasks"

    tasks: tuple = ()
    include_path: str = ""
    limit: int = 32
    num_fewshot: int = -1
    batch_size: int = 8
    max_length: int = 0
    max_gen_toks: int = 32

    def validate(self) -> None:
        if not isinstance(self.tasks, (list, tuple)) or not all(
                isinstance(t, str) and t.strip() for t in self.tasks):
            raise ConfigError("tasks", f"must be a list of lm-eval task names, got {self.tasks!r}")
        if not isinstance(self.include_path, str):
            raise ConfigError("include_path", f"must be a directory or '', got "
                              f"{self.include_path!r}")
        for name in ("limit", "batch_size", "max_gen_toks"):
            check_int(name, getattr(self, name), 1)
        check_int("num_fewshot", self.num_fewshot, -1)
        check_int("max_length", self.max_length, 0)


@dataclasses.dataclass(frozen=True)
class SampleConfig(Config):
    """Greedy generations logged every `train.sample_every` steps (`samples/<i>` in the
    metrics, and printed): from `prompts`, or else from the first `prompt_tokens` tokens of
    the first `count` rows of the held-out split (the same rows every time)."""

    section = "train.samples"

    prompts: tuple = ()
    count: int = 2
    prompt_tokens: int = 16
    max_new_tokens: int = 32

    def validate(self) -> None:
        if not isinstance(self.prompts, (list, tuple)) or not all(
                isinstance(p, str) and p for p in self.prompts):
            raise ConfigError("prompts", f"must be a list of non-empty strings, got "
                              f"{self.prompts!r}")
        for name in ("count", "prompt_tokens", "max_new_tokens"):
            check_int(name, getattr(self, name), 1)


def check_periodic(train: Any) -> None:
    """`TrainConfig`'s checks of these against its cadence and length (`train`: a TrainConfig;
    fields named relative to it)."""
    check_int("sample_every", train.sample_every, 0)
    if train.eval_tasks.tasks and not train.eval_every:
        raise ConfigError("eval_tasks", "run with the held-out evaluation: set train.eval_every")
    room = decoder_length(train)
    if train.sample_every and train.samples.prompt_tokens + train.samples.max_new_tokens > room:
        raise ConfigError("samples", f"prompt_tokens + max_new_tokens exceed the decoder's {room} "
                          "positions (train.eval_tasks.max_length, else train.seq_len)")


def decoder_length(train: Any) -> int:
    """Positions of the evaluations' decoder (its KV cache): `eval_tasks.max_length`, else
    `train.seq_len` (`train`: a TrainConfig)."""
    return train.eval_tasks.max_length or train.seq_len


def reads_heldout(train: Any) -> bool:
    """Whether a run (`train`: a TrainConfig) reads its held-out split: the held-out
    evaluation, or samples from held-out rows (no `samples.prompts`)."""
    return train.eval_every > 0 or (train.sample_every > 0 and not train.samples.prompts)
