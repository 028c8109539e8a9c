"""RL configuration: `RLRunConfig` = model + `RLConfig` + `TaskMixConfig` (rl/task_config.py),
read from one YAML.

A run YAML has an `rl:` section, a `task:` section and optionally a `model:` section (with
`--init-from`, only its FP4 QAT switches `qat` apply, to the checkpoint's model; a section of
`qat` alone is no model of its own). Dotted overrides
`rl.algorithm=ppo rl.actor.lr=1e-5 task.max_operand=49` work as in `python -m train`; the
device mesh is `rl.mesh` (`rl.mesh.data=2 rl.mesh.expert=2`, training's `mesh:` fields).
Defaults are the report's (5.2.1, 5.2.3): MIS-PO with token bounds [0.5, 2] and trajectory
bounds [0.996, 1.001], temperature and top-p 1.0, 16 samples per prompt, one epoch of 4 actor
and 12 critic minibatches, Muon with weight decay 0.1, actor lr 2e-6 after 20 warm-up updates,
critic lr 5e-6 after 50, gamma = lambda = 1, unbiased KL 0.001 (importance-weighted k3).

Baselines are presets of switches that work with every algorithm: a switch left unset (null)
takes the algorithm's value (`PRESETS`), an explicit one wins (`rl.algorithm=dapo
rl.dynamic_sampling=false` is DAPO without dynamic sampling).

| algorithm | group_std | loss_aggregation | dynamic_sampling | overlong_buffer | kl_coef, kl_estimator |
|---|---|---|---|---|---|
| grpo | true | sequence_mean | false | 0 | 0.04, k3 |
| dapo | true | token_mean | true | max_new_tokens // 5 | 0 |
| dr_grpo | false | token_sum | false | 0 | 0 |
| kimi_k25 | false | token_mean | false | 0 | 0 |
| mopd | true | sequence_mean | false | 0 | 0 |
| mis_po, ppo, gspo | true | token_mean | false | 0 | 0.001, k3_importance |

(`overlong_buffer`: DAPO's L_cache tokens; the KL is aggregated like the loss.) Each preset is
its paper's objective (rl/objectives/losses.py): `grpo` DeepSeekMath's (symmetric `grpo_clip`;
one update per rollout batch: `actor_minibatches` 1, else 4), `dapo` (`dapo_clip`), `dr_grpo`
(`ppo_clip`), `kimi_k25` (K2.5 eq. 1, `kimi_bounds`, `kimi_tau`); variants: one override away.

`rl.toggle` (Kimi K2.5's token-budget RL, rl/objectives/toggle.py and rl/budget.py) works with
every algorithm: `rl.toggle.enabled=true`. `mopd` is MiMo-V2-Flash's multi-teacher on-policy
distillation (eqs. 7-9, rl/distill/): a teacher per task, `rl.distill` for its weights.

Off-policy machinery, with every algorithm: `rl.routing_replay` (MiMo-V2-Flash's Rollout
Routing Replay, rl/routing_replay.py), `rl.max_staleness` (rollouts up to k policy versions
old, rl/staleness.py) with truncated importance sampling (`rl.tis`, `rl.tis_cap`,
rl/objectives/truncated_is.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

from model.config import (
    Config,
    ConfigError,
    ModelConfig,
    QATConfig,
    apply_overrides,
    build_dataclass,
    check_bool,
    check_choice,
    check_fraction,
    check_int,
    check_nonnegative,
    check_positive,
    config_from_dict,
    config_to_dict,
    read_yaml,
)
from rl.distill.config import DistillConfig, task_teachers
from rl.mesh_config import RLMeshConfig
from rl.objectives.kl import KL_ESTIMATORS
from rl.objectives.losses import AGGREGATIONS, KIMI_BOUNDS, KIMI_TAU
from rl.rollout_bounds import check_sampling, check_staleness
from rl.task_config import TaskMixConfig, task_config_from_dict
from rl.task_mix import allocate_prompts
from train.config import LoopConfig, check_override_sections, check_sections
from train.optim.config import OptimizerConfig

ALGORITHMS = ("mis_po", "ppo", "grpo", "gspo", "dapo", "dr_grpo", "kimi_k25", "mopd")
# Always group advantages, no critic (MOPD: eq. 9's A_ORM are GRPO's advantages).
GROUP_ALGORITHMS = ("grpo", "dapo", "dr_grpo", "kimi_k25", "mopd")
# Each switch's value per algorithm when the switch is unset (null); "*": every other algorithm.
PRESETS = {
    "group_std": {"dr_grpo": False, "kimi_k25": False, "*": True},
    "loss_aggregation": {"grpo": "sequence_mean", "dr_grpo": "token_sum",
                         "mopd": "sequence_mean", "*": "token_mean"},
    "dynamic_sampling": {"dapo": True, "*": False},
    "kl_coef": {"grpo": 0.04, "dapo": 0.0, "dr_grpo": 0.0, "kimi_k25": 0.0, "mopd": 0.0,
                "*": 0.001},
    "kl_estimator": {"grpo": "k3", "*": "k3_importance"},
}
ADVANTAGES = ("gae", "group")
INFERENCE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ToggleConfig(Config):
    """`rl.toggle`: Kimi K2.5's Toggle (its eq. 2). Iterations alternate in blocks of `period`
    (m) between a budget phase, where a response longer than its problem's budget earns no
    reward once the problem's group accuracy reaches `accuracy_threshold` (lambda), and an
    unconstrained phase. A problem's budget is the `percentile` (rho, 0-100) of the lengths of
    the correct ones among `budget_samples` (K) responses of the initial policy, estimated once
    at the start. The source gives none of the four values; these defaults are ours
    (docs/post_training.md, "Toggle")."""

    section = "rl.toggle"

    enabled: bool = False
    period: int = 10  # m: iterations per phase; phase 0 (budget) first
    accuracy_threshold: float = 0.5  # lambda: the budget binds once group accuracy >= this
    percentile: float = 50.0  # rho: the budget is this percentile of correct lengths
    budget_samples: int | None = None  # K at estimation; null = rl.samples_per_prompt

    def validate(self) -> None:
        check_bool("enabled", self.enabled)
        check_int("period", self.period, 1)
        check_fraction("accuracy_threshold", self.accuracy_threshold)
        if not isinstance(self.percentile, (int, float)) or isinstance(self.percentile, bool) \
                or not 0 <= self.percentile <= 100:
            raise ConfigError("percentile", f"must be a number in [0, 100], got "
                              f"{self.percentile!r}")
        if self.budget_samples is not None:
            check_int("budget_samples", self.budget_samples, 1)


@dataclasses.dataclass(frozen=True)
class RLConfig(LoopConfig):
    """The RL loop; `actor` and `critic` are each one model's optimizer (train/optim/config.py,
    warm-up then a constant rate). Seed, logging, checkpoints, progress and the compilation
    cache are the training loop's fields (`LoopConfig`) with RL's defaults."""

    section = "rl"

    algorithm: str = "mis_po"  # mis_po | ppo | grpo | gspo | dapo | dr_grpo | kimi_k25 | mopd
    iterations: int = 100
    prompts_per_iteration: int = 256  # P (report 5.2.3, reasoning tasks)
    samples_per_prompt: int = 16  # N
    max_new_tokens: int = 1024  # responses longer than this are truncated (eq. 3)
    temperature: float = 1.0
    top_p: float = 1.0
    actor_minibatches: int | None = None  # null: the algorithm's (derived_defaults)
    critic_minibatches: int = 12
    actor: OptimizerConfig = OptimizerConfig(lr=2e-6, warmup_steps=20)
    critic: OptimizerConfig = OptimizerConfig(lr=5e-6, warmup_steps=50)
    # gae: critic + GAE (report 5.2.1-5.2.3); group: each reward minus its prompt group's mean,
    # over the group's std (GRPO's estimator, no critic). GROUP_ALGORITHMS always use group.
    advantages: str = "gae"
    # The switches below: null = the algorithm's preset (module docstring).
    group_std: bool | None = None  # divide group advantages by the group's std
    loss_aggregation: str | None = None  # token_mean | sequence_mean | token_sum
    dynamic_sampling: bool | None = None  # DAPO: keep groups of 0 < #correct < G, draw more
    max_draws: int = 8  # dynamic sampling's draws per iteration at most (rl.dynamic_sampling)
    overlong_buffer: int | None = None  # DAPO's L_cache in tokens; 0 = no overlong shaping
    gamma: float = 1.0
    lam: float = 1.0
    token_bounds: tuple = (0.5, 2.0)  # MIS-PO token filter on pi_old / pi_infer (eq. 2)
    traj_bounds: tuple = (0.996, 1.001)  # ... on its geometric mean over a trajectory
    ppo_clip: tuple = (0.2, 0.2)  # (eps_low, eps_high) of PPO and Dr. GRPO
    grpo_clip: tuple = (0.2, 0.2)  # DeepSeekMath's GRPO: PPO's symmetric clip
    dapo_clip: tuple = (0.2, 0.28)  # DAPO clip-higher
    gspo_clip: float = 1e-4  # report App. D
    kimi_bounds: tuple = KIMI_BOUNDS  # Kimi K2.5 eq. 1: [alpha, beta] on pi_theta / pi_infer
    kimi_tau: float = KIMI_TAU  # ... and tau of its (log ratio)^2 penalty
    kl_coef: float | None = None  # KL to the initial policy; 0 = no reference model
    kl_estimator: str | None = None  # k3_importance | k3 (rl.objectives.kl)
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
    eval_prompts: int = 0  # held-out problems evaluated per task (0 = all)
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    mesh: RLMeshConfig = RLMeshConfig()  # data=-1: every device data-parallel, as training
    toggle: ToggleConfig = ToggleConfig()  # Kimi K2.5's token-budget phases (off by default)
    distill: DistillConfig = DistillConfig()  # on-policy distillation (rl/distill/)
    # Off-policy machinery (module docstring). routing_replay: the training forwards route as
    # the rollout did; max_staleness: k, train on batches drawn k iterations earlier; tis:
    # weight tokens by min(pi_old / pi_infer, tis_cap) (null: on iff max_staleness > 0 and the
    # algorithm is neither mopd, whose eq. 8 weight already is a truncated ratio to pi_infer,
    # nor kimi_k25, whose eq. 1 ratio already is to pi_infer).
    routing_replay: bool = False
    max_staleness: int = 0
    tis: bool | None = None
    tis_cap: float = 2.0  # C of Yao et al. (2025)

    def derived_defaults(self) -> dict[str, Any]:  # DeepSeekMath 4.2: a single GRPO update
        return {"actor_minibatches": 1 if self.algorithm == "grpo" else 4}  # per rollout batch

    @property
    def batch_size(self) -> int:
        return self.prompts_per_iteration * self.samples_per_prompt

    @property
    def uses_critic(self) -> bool:
        """GAE needs a value model; group advantages (always for GRPO, DAPO, Dr. GRPO) do not."""
        return self.algorithm not in GROUP_ALGORITHMS and self.advantages == "gae"

    # The switches as this algorithm resolves them (module docstring).

    def preset(self, name: str):
        """Switch `name`'s value: its own if set, else this algorithm's (`PRESETS`)."""
        value = getattr(self, name)
        if value is not None:
            return value
        table = PRESETS[name]
        return table.get(self.algorithm, table["*"])

    @property
    def divides_by_group_std(self) -> bool:
        return self.preset("group_std")

    @property
    def aggregation(self) -> str:
        return self.preset("loss_aggregation")

    @property
    def samples_dynamically(self) -> bool:
        return self.preset("dynamic_sampling")

    @property
    def kl_weight(self) -> float:
        """The KL term's coefficient; 0: no reference policy is kept."""
        return self.preset("kl_coef")

    @property
    def kl_method(self) -> str:
        return self.preset("kl_estimator")

    @property
    def overlong_buffer_tokens(self) -> int:
        if self.overlong_buffer is not None:
            return self.overlong_buffer
        return max(1, self.max_new_tokens // 5) if self.algorithm == "dapo" else 0

    @property
    def uses_tis(self) -> bool:
        if self.tis is not None:
            return self.tis
        return self.max_staleness > 0 and self.algorithm not in ("mopd", "kimi_k25")

    @property
    def budget_samples(self) -> int:
        """K of Toggle's budget estimation: `rl.toggle.budget_samples`, else N."""
        return self.toggle.budget_samples or self.samples_per_prompt

    def validate(self) -> None:
        super().validate()
        check_choice("algorithm", self.algorithm, ALGORITHMS)
        check_choice("advantages", self.advantages, ADVANTAGES)
        for name in ("iterations", "prompts_per_iteration", "samples_per_prompt",
                     "max_new_tokens", "actor_minibatches", "critic_minibatches"):
            check_int(name, getattr(self, name), 1)
        check_int("eval_prompts", self.eval_prompts, 0)
        check_sampling(self.temperature, self.top_p)
        check_fraction("gamma", self.gamma)
        check_fraction("lam", self.lam)
        for name in ("token_bounds", "traj_bounds", "ppo_clip", "grpo_clip", "dapo_clip",
                     "kimi_bounds"):
            _check_pair(name, getattr(self, name))
        for name in ("token_bounds", "traj_bounds", "kimi_bounds"):
            low, high = getattr(self, name)
            if not 0 < low <= 1 <= high:
                raise ConfigError(name, f"need 0 < low <= 1 <= high, got [{low}, {high}]")
        for name in ("ppo_clip", "grpo_clip", "dapo_clip"):
            low, high = getattr(self, name)
            if not (0 <= low < 1 and high >= 0):
                raise ConfigError(name, f"need 0 <= eps_low < 1 and eps_high >= 0, "
                                  f"got [{low}, {high}]")
        check_positive("gspo_clip", self.gspo_clip)
        check_nonnegative("kimi_tau", self.kimi_tau)
        check_positive("entropy_top_frac", self.entropy_top_frac)
        check_fraction("entropy_top_frac", self.entropy_top_frac)
        check_bool("truncation_bootstrap", self.truncation_bootstrap)
        check_choice("inference_dtype", self.inference_dtype, INFERENCE_DTYPES)
        check_bool("routing_replay", self.routing_replay)
        check_staleness(self.max_staleness, self.iterations)
        if self.tis is not None:
            check_bool("tis", self.tis)
        check_positive("tis_cap", self.tis_cap)
        used = ("actor", "critic") if self.uses_critic else ("actor",)  # no critic: not split
        for name in used:
            if self.batch_size < getattr(self, f"{name}_minibatches"):
                raise ConfigError(f"{name}_minibatches", f"{self.batch_size} rollouts per "
                                  f"iteration (rl.prompts_per_iteration x rl.samples_per_prompt) "
                                  f"cannot fill {getattr(self, f'{name}_minibatches')} minibatches")
        self._validate_switches()
        # MOPD (eq. 9) adds its teachers' signal to the group advantages: that one still trains.
        if not self.uses_critic and self.algorithm != "mopd" and self.samples_per_prompt < 2:
            why, fix = ((f"rl.algorithm={self.algorithm} uses group advantages", "raise it")
                        if self.algorithm in GROUP_ALGORITHMS else
                        ("rl.advantages=group", "raise it or use rl.advantages=gae"))
            raise ConfigError("samples_per_prompt", f"{why}: a group of 1 sample has advantage "
                              f"0 and trains nothing; {fix}")
        self._validate_warmups()
        # Estimation decodes batches of rl.batch_size rows (the rollouts' shape: no new
        # compilation, and the rows split over the mesh as the rollouts do).
        if self.toggle.enabled and self.batch_size % self.budget_samples:
            raise ConfigError("toggle.budget_samples", f"{self.budget_samples} must divide the "
                              f"{self.batch_size} rollouts per iteration (rl.prompts_per_iteration"
                              " x rl.samples_per_prompt)")

    def _validate_switches(self) -> None:
        for name in ("group_std", "dynamic_sampling"):
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))
        if self.kl_coef is not None:
            check_nonnegative("kl_coef", self.kl_coef)
        if self.kl_estimator is not None:
            check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.loss_aggregation is not None:
            check_choice("loss_aggregation", self.loss_aggregation, AGGREGATIONS)
        check_int("max_draws", self.max_draws, 1)
        if self.overlong_buffer is not None and (
                isinstance(self.overlong_buffer, bool) or not isinstance(self.overlong_buffer, int)
                or not 0 <= self.overlong_buffer <= self.max_new_tokens):
            raise ConfigError("overlong_buffer", f"must be an integer in [0, rl.max_new_tokens="
                              f"{self.max_new_tokens}], got {self.overlong_buffer!r}")
        if self.samples_dynamically and self.samples_per_prompt < 2:
            raise ConfigError("dynamic_sampling", "needs rl.samples_per_prompt >= 2 (a group of "
                              "one sample never has rewards that differ)")

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
class RLRunConfig(Config):
    model: ModelConfig | None  # None: taken from the --init-from checkpoint
    rl: RLConfig
    task: TaskMixConfig
    qat: QATConfig | None = None  # a model: section of `qat` alone, for --init-from's model

    def validate(self) -> None:
        counts = allocate_prompts(self.task.weights, self.rl.prompts_per_iteration)
        for task, count in zip(self.task.tasks, counts):
            if count == 0:
                raise ConfigError(f"task.tasks.{task.name}.weight", f"{task.weight} of "
                                  f"rl.prompts_per_iteration={self.rl.prompts_per_iteration} "
                                  "prompts rounds to none; raise the weight or the prompts")
        if self.rl.algorithm == "mopd" and not task_teachers(self.rl.distill, self.task.tasks):
            raise ConfigError("rl.distill.teacher.checkpoint", "rl.algorithm=mopd needs a "
                              "teacher: give task.tasks.<name>.teacher.checkpoint per task or "
                              "this run-wide one")

    def to_dict(self) -> dict:
        """What `rl_config_from_dict` reads back: without a model, its section of QAT switches
        alone (or null)."""
        model = (config_to_dict(self.model) if self.model is not None else
                 None if self.qat is None else {"qat": config_to_dict(self.qat)})
        return {"model": model, "rl": config_to_dict(self.rl), "task": self.task.to_dict()}

    def with_model(self, model: ModelConfig, *, checkpoint: bool = False) -> "RLRunConfig":
        """`checkpoint`: --init-from's model, taking this run's `model.qat` (not architecture)."""
        qat = self.qat if self.qat is not None else getattr(self.model, "qat", None)
        if not checkpoint or qat is None:
            return dataclasses.replace(self, model=model)
        try:
            return dataclasses.replace(self, model=model.replace(qat=qat))
        except ConfigError as err:  # a switch for a part the checkpoint's model lacks
            raise err.within("model") from None


SECTIONS = ("model", "rl", "task")


def _check_pair(name: str, value: Any) -> None:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        raise ConfigError(name, f"expected two numbers, got {value!r}")


def rl_config_from_dict(values: Mapping[str, Any]) -> RLRunConfig:
    check_sections(values, SECTIONS)
    section = values.get("model") or {}
    alone = isinstance(section, Mapping) and set(section) == {"qat"}  # no model of their own
    model = config_from_dict(section, "model.") if section and not alone else None
    qat = build_dataclass(QATConfig, section["qat"], "model.qat.") if alone else None
    return RLRunConfig(model=model, rl=build_dataclass(RLConfig, values.get("rl") or {}, "rl."),
                       task=task_config_from_dict(values.get("task")), qat=qat)


def load_rl_config(path: str | Path, overrides: Sequence[str] = ()) -> RLRunConfig:
    values = read_yaml(path)
    check_override_sections(overrides, {"rl": RLConfig, "task": TaskMixConfig,
                                        "model": ModelConfig})
    return rl_config_from_dict(apply_overrides(values, overrides))
