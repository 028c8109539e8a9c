"""The optimizer's hyperparameters as config groups (train/optim/optimizer.py builds from plain
values; these dataclasses hold them in a run YAML under `train:`, `rl.actor:` and `rl.critic:`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from model.config import (
    Config,
    ConfigError,
    check_bool,
    check_choice,
    check_fraction,
    check_int,
    check_nonnegative,
    check_positive,
    config_to_dict,
)
from train.optim.muon import ITERATION_DTYPES, ORTHOGONALIZERS
from train.optim.optimizer import TRAINABLE

OPTIMIZERS = ("muon", "adamw")
# Optimizer fields a resumed run may change (dotted, under the optimizer's section): they round
# Muon's iteration only; its momentum is float32 whatever the dtype.
RESUMABLE_OPTIMIZER_CHANGES = {"muon.iteration_dtype"}


@dataclasses.dataclass(frozen=True)
class MuonConfig(Config):
    """Muon on hidden weight matrices (report 4.1.1, 4.2.3); the keyword arguments of
    `train.optim.muon.scale_by_muon`."""

    momentum: float = 0.95
    nesterov: bool = True
    # train.optim.muon.ORTHOGONALIZERS: polar_express (Step 3.5, report 4.1.1), newton_schulz
    # (the classic quintic), hybrid_newton_schulz (DeepSeek-V4 report 2.4, eq. 28). `steps` and
    # `update_rms` left unset take the orthogonalizer's defaults: 6 and 0.2 for Polar Express
    # (report 4.1.1), 5 and 0.2 for Newton-Schulz, 10 and 0.18 for the hybrid (V4 report
    # eq. 28, 4.2.2); a value given explicitly wins.
    orthogonalizer: str = "polar_express"
    steps: int | None = None  # iterations in all
    # Of those, the last ones with the finishing polynomial (2, -1.5, 0.5); None: the
    # orthogonalizer's default (2 for hybrid_newton_schulz; the others have none).
    finish_steps: int | None = None
    # State and intermediates of the iteration (report 4.1.1: float16). 'auto': float16 on GPU,
    # float32 on CPU (float16 matmuls are float32 ones plus conversions there) and TPU (no
    # float16 MXU path); see train.optim.muon.resolve_iteration_dtype.
    iteration_dtype: str = "auto"
    # Update-RMS matching: scale the orthogonalised update to this RMS so AdamW's learning rate
    # and weight decay carry over (Moonlight: 0.2); 0 = the original sqrt(max(1, m/n)) scale.
    update_rms: float | None = None

    def derived_defaults(self) -> dict[str, Any]:
        method = ORTHOGONALIZERS.get(self.orthogonalizer)  # an unknown one is named by validate
        return {} if method is None else {"steps": method.steps, "update_rms": method.update_rms}

    def validate(self) -> None:
        check_fraction("momentum", self.momentum)
        check_bool("nesterov", self.nesterov)
        check_choice("orthogonalizer", self.orthogonalizer, tuple(ORTHOGONALIZERS))
        check_int("steps", self.steps, 1)
        if self.finish_steps is not None:
            check_int("finish_steps", self.finish_steps, 0)
        try:
            ORTHOGONALIZERS[self.orthogonalizer].coefficients(self.steps, self.finish_steps)
        except ValueError as err:
            raise ConfigError("finish_steps", str(err).removeprefix("orthogonalize: ")) from None
        check_choice("iteration_dtype", self.iteration_dtype, ITERATION_DTYPES)
        check_nonnegative("update_rms", self.update_rms)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Config):
    """One model's optimizer (train/optim/optimizer.py): Muon on hidden matrices, AdamW on the
    rest, a linear warm-up to `lr`. Pre-training (`train:`, which adds the decay after warm-up)
    and RL's actor and critic (`rl.actor:`, `rl.critic:`, constant after warm-up) share it."""

    optimizer: str = "muon"
    lr: float = 3e-3  # peak learning rate (Muon and AdamW groups alike, thanks to RMS matching)
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    muon: MuonConfig = MuonConfig()
    freeze_router: bool = False  # mid-/post-training (report 3.2, 4.2): router weights fixed
    # `indexer`: only the CSA lightning indexers train, everything else is frozen (DeepSeek-V4's
    # indexer warm-up, report 4.2.2; with model.shared_kv_attention.csa_attention=dense).
    trainable: str = "all"

    def validate(self) -> None:
        super().validate()
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_positive("lr", self.lr)
        check_int("warmup_steps", self.warmup_steps, 0)
        for name in ("weight_decay", "grad_clip", "adam_eps"):
            check_nonnegative(name, getattr(self, name))
        check_fraction("adam_b1", self.adam_b1)
        check_fraction("adam_b2", self.adam_b2)
        check_bool("freeze_router", self.freeze_router)
        check_choice("trainable", self.trainable, TRAINABLE)

    def schedule_settings(self) -> dict[str, Any]:
        """Keyword arguments of `train.optim.schedules.learning_rate_schedule`."""
        return {"lr": self.lr, "warmup_steps": self.warmup_steps}

    def optimizer_settings(self) -> dict[str, Any]:
        """Keyword arguments of `train.optim.optimizer.build_optimizer` (the learning rate and
        the trained MTP heads aside)."""
        return {"optimizer": self.optimizer, "weight_decay": self.weight_decay,
                "grad_clip": self.grad_clip, "adam_b1": self.adam_b1, "adam_b2": self.adam_b2,
                "adam_eps": self.adam_eps, "muon": config_to_dict(self.muon),
                "freeze_router": self.freeze_router, "trainable": self.trainable}
