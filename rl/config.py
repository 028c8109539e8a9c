"""RL configuration: `RLRunConfig` = model + `RLConfig` + `TaskConfig`, read from one YAML.

A run YAML has an `rl:` section, a `task:` section and optionally a `model:` section (used only
when the policy is not initialised from a checkpoint with `--init-from`). Dotted overrides
`rl.algorithm=ppo rl.actor.lr=1e-5 task.max_operand=49` work as in `python -m train`.
Defaults are the report's (5.2.1, 5.2.3): MIS-PO with token bounds [0.5, 2] and trajectory
bounds [0.996, 1.001], temperature and top-p 1.0, 16 samples per prompt, one epoch of 4 actor
and 12 critic minibatches, Muon with weight decay 0.1, actor lr 2e-6 after 20 warm-up updates,
critic lr 5e-6 after 50, gamma = lambda = 1, unbiased KL 0.001.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

from model.config import (
    ModelConfig, apply_overrides, build_dataclass, check_bool, check_choice, check_fraction,
    check_int, check_nonnegative, check_positive, config_from_dict, config_to_dict, read_yaml,
)
from train.config import OPTIMIZERS, TrainConfig, check_override_sections

ALGORITHMS = ("mis_po", "ppo", "grpo", "gspo")
ADVANTAGES = ("gae", "group")
TASKS = ("arithmetic",)
INFERENCE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """One model's optimizer: Muon (AdamW for embeddings, heads and 1-D params) with linear
    warm-up to a constant learning rate (train/optim/optimizer.py)."""

    lr: float = 2e-6
    warmup_steps: int = 20
    optimizer: str = "muon"
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    freeze_router: bool = False  # keep the MoE router weights fixed (as in mid-training, 3.2)

    def validate(self, prefix: str) -> None:
        check_positive(f"{prefix}.lr", self.lr)
        check_int(f"{prefix}.warmup_steps", self.warmup_steps, 0)
        check_choice(f"{prefix}.optimizer", self.optimizer, OPTIMIZERS)
        check_nonnegative(f"{prefix}.weight_decay", self.weight_decay)
        check_nonnegative(f"{prefix}.grad_clip", self.grad_clip)
        check_bool(f"{prefix}.freeze_router", self.freeze_router)

    def train_config(self) -> TrainConfig:
        """The training optimizer's settings for `train.optim.optimizer.build_optimizer`."""
        return dataclasses.replace(
            TrainConfig(), optimizer=self.optimizer, lr=self.lr, min_lr=self.lr,
            warmup_steps=self.warmup_steps, schedule="constant",
            weight_decay=self.weight_decay, grad_clip=self.grad_clip,
            freeze_router=self.freeze_router)


@dataclasses.dataclass(frozen=True)
class RLConfig:
    algorithm: str = "mis_po"  # mis_po | ppo | grpo | gspo
    iterations: int = 100
    prompts_per_iteration: int = 256  # P (report 5.2.3, reasoning tasks)
    samples_per_prompt: int = 16  # N
    max_new_tokens: int = 1024  # responses longer than this are truncated (eq. 3)
    temperature: float = 1.0
    top_p: float = 1.0
    actor_minibatches: int = 4
    critic_minibatches: int = 12
    actor: OptimizerConfig = OptimizerConfig(lr=2e-6, warmup_steps=20)
    critic: OptimizerConfig = OptimizerConfig(lr=5e-6, warmup_steps=50)
    # gae: critic + GAE (report 5.2.1-5.2.3); group: each reward minus its prompt group's mean,
    # over the group's std (GRPO's estimator, no critic). GRPO always uses group.
    advantages: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    token_bounds: tuple = (0.5, 2.0)  # MIS-PO token filter on pi_old / pi_infer (eq. 2)
    traj_bounds: tuple = (0.996, 1.001)  # ... on its geometric mean over a trajectory
    ppo_clip: tuple = (0.2, 0.2)  # (eps_low, eps_high) of PPO
    grpo_clip: tuple = (0.2, 0.28)  # DAPO clip-higher
    gspo_clip: float = 1e-4  # report App. D
    kl_coef: float = 0.001  # unbiased KL to the initial policy; 0 = no reference model
    # Seed 003: keep only the top fraction of response tokens by entropy in the actor loss
    # (0.2 there); 1.0 = every token.
    entropy_top_frac: float = 1.0
    truncation_bootstrap: bool = True  # eq. 3
    # The inference path computes in this dtype, the training path in the model's
    # compute_dtype, so pi_infer and pi_old really differ (report 5.2: training-inference
    # mismatch). Params stay float32.
    inference_dtype: str = "bfloat16"
    tokenizer: str = "arith_chars"  # as train.data.tokenizer
    seed: int = 0
    log_every: int = 1
    eval_every: int = 10  # iterations between held-out evaluations (0 = only at the end)
    eval_prompts: int = 0  # held-out problems evaluated (0 = all)
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    progress: bool = True
    xla_cache_dir: str = "~/.cache/stepjax/xla"

    @property
    def batch_size(self) -> int:
        return self.prompts_per_iteration * self.samples_per_prompt

    @property
    def uses_critic(self) -> bool:
        """GAE needs a value model; group advantages (always for GRPO) do not."""
        return self.algorithm != "grpo" and self.advantages == "gae"

    def validate(self) -> None:
        check_choice("rl.algorithm", self.algorithm, ALGORITHMS)
        check_choice("rl.advantages", self.advantages, ADVANTAGES)
        for name in ("iterations", "prompts_per_iteration", "samples_per_prompt",
                     "max_new_tokens", "actor_minibatches", "critic_minibatches", "log_every",
                     "checkpoint_every", "keep_checkpoints"):
            check_int(f"rl.{name}", getattr(self, name), 1)
        for name in ("seed", "eval_every", "eval_prompts"):
            check_int(f"rl.{name}", getattr(self, name), 0)
        check_positive("rl.temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rl.top_p: must be in (0, 1], got {self.top_p}")
        self.actor.validate("rl.actor")
        self.critic.validate("rl.critic")
        check_fraction("rl.gamma", self.gamma)
        check_fraction("rl.lam", self.lam)
        for name in ("token_bounds", "traj_bounds", "ppo_clip", "grpo_clip"):
            _check_pair(f"rl.{name}", getattr(self, name))
        for name in ("token_bounds", "traj_bounds"):
            low, high = getattr(self, name)
            if not 0 < low <= 1 <= high:
                raise ValueError(f"rl.{name}: need 0 < low <= 1 <= high, got [{low}, {high}]")
        for name in ("ppo_clip", "grpo_clip"):
            low, high = getattr(self, name)
            if not (0 <= low < 1 and high >= 0):
                raise ValueError(f"rl.{name}: need 0 <= eps_low < 1 and eps_high >= 0, "
                                 f"got [{low}, {high}]")
        check_positive("rl.gspo_clip", self.gspo_clip)
        check_nonnegative("rl.kl_coef", self.kl_coef)
        check_positive("rl.entropy_top_frac", self.entropy_top_frac)
        check_fraction("rl.entropy_top_frac", self.entropy_top_frac)
        check_bool("rl.truncation_bootstrap", self.truncation_bootstrap)
        check_choice("rl.inference_dtype", self.inference_dtype, INFERENCE_DTYPES)
        check_bool("rl.progress", self.progress)
        if self.batch_size < max(self.actor_minibatches, self.critic_minibatches):
            raise ValueError(f"rl: {self.batch_size} rollouts per iteration cannot fill "
                             f"{max(self.actor_minibatches, self.critic_minibatches)} minibatches")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The prompt source and its verifier. `arithmetic`: every `a op b` with operands in
    [0, max_operand] and op in `ops`; `heldout_fraction` of them (by hash, the same as the SFT
    corpus `arith`) are only evaluated on."""

    name: str = "arithmetic"
    max_operand: int = 99
    ops: str = "+-"
    heldout_fraction: float = 0.05

    def validate(self) -> None:
        check_choice("task.name", self.name, TASKS)
        check_int("task.max_operand", self.max_operand, 1)
        if not isinstance(self.ops, str) or not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"task.ops: must be a non-empty string of + - *, got {self.ops!r}")
        check_fraction("task.heldout_fraction", self.heldout_fraction)


@dataclasses.dataclass(frozen=True)
class RLRunConfig:
    model: ModelConfig | None  # None: taken from the --init-from checkpoint
    rl: RLConfig
    task: TaskConfig

    def to_dict(self) -> dict:
        return {"model": None if self.model is None else config_to_dict(self.model),
                "rl": config_to_dict(self.rl), "task": config_to_dict(self.task)}

    def with_model(self, model: ModelConfig) -> "RLRunConfig":
        return dataclasses.replace(self, model=model)


SECTIONS = ("model", "rl", "task")


def _check_pair(name: str, value: Any) -> None:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        raise ValueError(f"{name}: expected two numbers, got {value!r}")


def rl_config_from_dict(values: Mapping[str, Any]) -> RLRunConfig:
    unknown = set(values) - set(SECTIONS)
    if unknown:
        raise ValueError(f"config: unknown top-level section(s) {sorted(unknown)}; expected "
                         f"{', '.join(SECTIONS)}")
    model = config_from_dict(values["model"]) if values.get("model") else None
    rl = build_dataclass(RLConfig, values.get("rl") or {}, "rl.")
    rl.validate()
    task = build_dataclass(TaskConfig, values.get("task") or {}, "task.")
    task.validate()
    return RLRunConfig(model=model, rl=rl, task=task)


def load_rl_config(path: str | Path, overrides: Sequence[str] = ()) -> RLRunConfig:
    values = read_yaml(path)
    check_override_sections(overrides, ("rl", "task", "model"))
    return rl_config_from_dict(apply_overrides(values, overrides))
