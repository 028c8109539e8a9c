"""RL configuration: `RLRunConfig` = model + `RLConfig` + `TaskConfig`, read from one YAML.

A run YAML has an `rl:` section, a `task:` section and optionally a `model:` section (used only
when the policy is not initialised from a checkpoint with `--init-from`). Dotted overrides
`rl.algorithm=ppo rl.actor.lr=1e-5 task.max_operand=49` work as in `python -m train`; the
device mesh is `rl.mesh` (`rl.mesh.data=2 rl.mesh.expert=2`, training's `mesh:` fields).
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
    Config,
    ConfigError,
    ModelConfig,
    apply_overrides,
    build_dataclass,
    check_bool,
    check_choice,
    check_fraction,
    check_int,
    check_nonnegative,
    check_open_fraction,
    check_positive,
    config_from_dict,
    config_to_dict,
    read_yaml,
)
from train.config import LoopConfig, MeshConfig, check_override_sections
from train.optim.config import OptimizerConfig

ALGORITHMS = ("mis_po", "ppo", "grpo", "gspo")
ADVANTAGES = ("gae", "group")
TASKS = ("arithmetic",)
INFERENCE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RLMeshConfig(MeshConfig):
    """`rl.mesh`: the training mesh (`mesh:` of a training run, README "Parallelism") for the
    actor, critic, reference policy and rollouts (rl/parallel.py). No pipeline axis: the
    decoder runs whole layers (model/layers/stack.py refuses KV caches under one)."""

    section = "rl.mesh"

    def validate(self) -> None:
        super().validate()
        if self.pipeline != 1:
            raise ConfigError("pipeline", f"RL does not pipeline (rollouts decode with KV caches, "
                              f"which need whole layers), got {self.pipeline}; use data, fsdp, "
                              "expert or tensor")


@dataclasses.dataclass(frozen=True)
class RLConfig(LoopConfig):
    """The RL loop; `actor` and `critic` are each one model's optimizer (train/optim/config.py,
    warm-up then a constant rate). Seed, logging, checkpoints, progress and the compilation
    cache are the training loop's fields (`LoopConfig`) with RL's defaults."""

    section = "rl"

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
    log_every: int = 1
    eval_every: int = 10  # iterations between held-out evaluations (0 = only at the end)
    eval_prompts: int = 0  # held-out problems evaluated (0 = all)
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    mesh: RLMeshConfig = RLMeshConfig()  # data=-1: every device data-parallel, as training

    @property
    def batch_size(self) -> int:
        return self.prompts_per_iteration * self.samples_per_prompt

    @property
    def uses_critic(self) -> bool:
        """GAE needs a value model; group advantages (always for GRPO) do not."""
        return self.algorithm != "grpo" and self.advantages == "gae"

    def validate(self) -> None:
        super().validate()
        check_choice("algorithm", self.algorithm, ALGORITHMS)
        check_choice("advantages", self.advantages, ADVANTAGES)
        for name in ("iterations", "prompts_per_iteration", "samples_per_prompt",
                     "max_new_tokens", "actor_minibatches", "critic_minibatches"):
            check_int(name, getattr(self, name), 1)
        check_int("eval_prompts", self.eval_prompts, 0)
        check_positive("temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        check_fraction("gamma", self.gamma)
        check_fraction("lam", self.lam)
        for name in ("token_bounds", "traj_bounds", "ppo_clip", "grpo_clip"):
            _check_pair(name, getattr(self, name))
        for name in ("token_bounds", "traj_bounds"):
            low, high = getattr(self, name)
            if not 0 < low <= 1 <= high:
                raise ConfigError(name, f"need 0 < low <= 1 <= high, got [{low}, {high}]")
        for name in ("ppo_clip", "grpo_clip"):
            low, high = getattr(self, name)
            if not (0 <= low < 1 and high >= 0):
                raise ConfigError(name, f"need 0 <= eps_low < 1 and eps_high >= 0, "
                                  f"got [{low}, {high}]")
        check_positive("gspo_clip", self.gspo_clip)
        check_nonnegative("kl_coef", self.kl_coef)
        check_positive("entropy_top_frac", self.entropy_top_frac)
        check_fraction("entropy_top_frac", self.entropy_top_frac)
        check_bool("truncation_bootstrap", self.truncation_bootstrap)
        check_choice("inference_dtype", self.inference_dtype, INFERENCE_DTYPES)
        if self.batch_size < max(self.actor_minibatches, self.critic_minibatches):
            raise ConfigError("", f"{self.batch_size} rollouts per iteration cannot fill "
                              f"{max(self.actor_minibatches, self.critic_minibatches)} minibatches")
        self._validate_warmups()

    def _validate_warmups(self) -> None:
        """A warm-up counts optimizer updates: one per minibatch of every iteration."""
        for name in ("actor", "critic") if self.uses_critic else ("actor",):
            minibatches = getattr(self, f"{name}_minibatches")
            updates, warmup = self.iterations * minibatches, getattr(self, name).warmup_steps
            if warmup > updates:
                raise ConfigError(f"{name}.warmup_steps", f"{warmup} warm-up updates exceed the "
                                  f"run's {updates} (rl.iterations={self.iterations} x "
                                  f"rl.{name}_minibatches={minibatches}); set "
                                  f"rl.{name}.warmup_steps <= {updates}")


@dataclasses.dataclass(frozen=True)
class TaskConfig(Config):
    """The prompt source and its verifier. `arithmetic`: every `a op b` with operands in
    [0, max_operand] and op in `ops`; `heldout_fraction` of them (by hash, the same as the SFT
    corpus `arith`) are only evaluated on."""

    section = "task"

    name: str = "arithmetic"
    max_operand: int = 99
    ops: str = "+-"
    heldout_fraction: float = 0.05

    def validate(self) -> None:
        check_choice("name", self.name, TASKS)
        check_int("max_operand", self.max_operand, 1)
        if not isinstance(self.ops, str) or not self.ops or set(self.ops) - set("+-*"):
            raise ConfigError("ops", f"must be a non-empty string of + - *, got {self.ops!r}")
        check_open_fraction("heldout_fraction", self.heldout_fraction)


@dataclasses.dataclass(frozen=True)
class RLRunConfig(Config):
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
        raise ConfigError(name, f"expected two numbers, got {value!r}")


def rl_config_from_dict(values: Mapping[str, Any]) -> RLRunConfig:
    unknown = set(values) - set(SECTIONS)
    if unknown:
        raise ValueError(f"config: unknown top-level section(s) {sorted(unknown)}; expected "
                         f"{', '.join(SECTIONS)}")
    model = config_from_dict(values["model"]) if values.get("model") else None
    return RLRunConfig(model=model, rl=build_dataclass(RLConfig, values.get("rl") or {}, "rl."),
                       task=build_dataclass(TaskConfig, values.get("task") or {}, "task."))


def load_rl_config(path: str | Path, overrides: Sequence[str] = ()) -> RLRunConfig:
    values = read_yaml(path)
    check_override_sections(overrides, ("rl", "task", "model"))
    return rl_config_from_dict(apply_overrides(values, overrides))
