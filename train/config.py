"""Training configuration: `TrainConfig` (frozen dataclass tree) next to the `ModelConfig`.

A run is described by one YAML file with a `model:` section (or a model preset's fields at top
level) and a `train:` section (may be left out: defaults) plus dotted overrides
`model.d_model=256 train.lr=1e-3`. Defaults follow the report's pre-training recipe (section 3.1 /
4.1): Muon, weight decay 0.1, clip 1.0, warm-up then cosine, MTP loss weight 0.3 on MTP-1,
EP-group balance loss 0.001, loss-free bias rate 0.001.
`TrainConfig` takes its optimizer fields from `OptimizerConfig` (train/optim/config.py) and its
seed/logging/checkpoint fields from `LoopConfig`, both shared with RL (rl/config.py) under the
same YAML keys. Every config validates on construction (model/config/core.py).
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
    check_int,
    check_nonnegative,
    config_from_dict,
    config_to_dict,
    did_you_mean,
    dotted_names,
    expand_layout,
    model_values,
    read_yaml,
)
from model.config.model_config import INT32_MAX
from model.parallel.rules import MESH_AXES
from train.anticipatory_routing import AnticipatoryRoutingConfig
from train.data.config import DataConfig
from train.optim.config import OptimizerConfig
from train.optim.schedules import decay_start
from train.periodic_config import SampleConfig, TaskEvalConfig, check_periodic
from train.preset_fit import fit_warmup
from train.resume_fields import incompatible_fields
from train.telemetry.wandb_sink import WandbConfig
from train.yaml_kinds import RUN_SECTIONS, check_run_yaml

SCHEDULES = ("cosine", "constant", "stages")
# Which targets a chat document trains on (train/data/chat.py): its assistant turns, all its
# tokens, or `auto`: the assistant turns when the data holds chats. Plain text trains on all.
LOSS_MASKS = ("auto", "assistant", "all")
STAGE_SHAPES = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class LoopConfig(Config):
    """What a training loop does besides the math, shared by `train:` and `rl:` (which sets
    other defaults): seed, logging (W&B too), evaluation and checkpoint cadence, progress, and
    JAX's persistent compilation cache (a re-run skips the ~40 s compile of the tiny model's
    step on CPU; "" turns it off)."""

    seed: int = 0
    log_every: int = 10
    eval_every: int = 0  # 0 = no periodic held-out evaluation
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    progress: bool = True
    xla_cache_dir: str = "~/.cache/stepjax/xla"
    wandb: WandbConfig = WandbConfig()  # Weights & Biases logging, off while its project is ""

    def validate(self) -> None:
        super().validate()
        for name in ("log_every", "checkpoint_every", "keep_checkpoints"):
            check_int(name, getattr(self, name), 1)
        for name in ("seed", "eval_every"):
            check_int(name, getattr(self, name), 0)
        check_bool("progress", self.progress)
        if not isinstance(self.xla_cache_dir, str):
            raise ConfigError("xla_cache_dir", f"must be a directory path or '', "
                              f"got {self.xla_cache_dir!r}")


@dataclasses.dataclass(frozen=True)
class TrainConfig(OptimizerConfig, LoopConfig):
    section = "train"

    steps: int = 1000
    batch_size: int = 8  # sequences per optimizer step (all hosts together)
    micro_batch_size: int = 0  # > 0: gradient accumulation over batch_size / micro_batch_size
    # Batch-size warm-up (report 3.1): ((until_step, batch_size), ...) with increasing steps:
    # steps before the first until_step use the first size, and so on; then `batch_size`.
    # Every size must be a multiple of the micro-batch.
    batch_warmup: tuple = ()
    seq_len: int = 256

    min_lr: float = 3e-4  # floor of the cosine
    schedule: str = "cosine"
    # schedule: stages -> ((steps, end_lr, shape), ...) after warm-up; shape cosine|linear|constant.
    lr_stages: tuple = ()
    # This run trains steps [schedule_offset, schedule_offset + steps) of a schedule
    # schedule_steps long (0: it ends with the run): a recipe stage's slice of one schedule.
    schedule_offset: int = 0
    schedule_steps: int = 0

    loss_chunk_size: int = 1024  # tokens per chunk of the float32 cross-entropy
    loss_mask: str = "auto"  # LOSS_MASKS: chat data trains on its assistant turns under auto
    # MTP (report 2.2 / 3.1): loss mtp_loss_weight (0.3; 0.1 in stage 2) x sum_h w_h L_h, w the
    # per-offset weights (summing to 1: it is the total); only MTP-1 trains in main training.
    mtp_loss_weight: float = 0.3
    # MTP weight from the LR decay's start on (DeepSeek-V4 report 4.2.2: 0.3 -> 0.1); None: same
    mtp_loss_weight_at_decay: float | None = None
    mtp_offset_weights: tuple = (1.0,)
    # Per MoE layer with learned routing (summed over them, model.lm.collect_aux): the EP-group
    # loss (eq. 1) and the sequence-wise one (DeepSeek-V4 1e-4, MiMo-V2-Flash 1e-5).
    balance_loss_coef: float = 0.001
    router_bias_rate: float = 0.001  # loss-free balancing update u
    sequence_balance_coef: float = 0.0
    # The CSA lightning indexer's KL loss (model/ops/sparse_indexer.py); it trains only the
    # indexer, whose inputs are detached, so 0 switches the indexer's learning off.
    indexer_loss_coef: float = 1.0

    eval_batches: int = 4
    eval_tasks: TaskEvalConfig = TaskEvalConfig()  # lm-eval tasks at eval_every (train/periodic.py)
    sample_every: int = 0  # 0 = none; else log greedy generations (`samples`) every N steps
    samples: SampleConfig = SampleConfig()
    # The weights a new run starts from (`--init-from`; train/init_from.py); "" = random init
    init_from: str = ""
    max_consecutive_skips: int = 5  # non-finite loss/grad skips before giving up
    peak_flops: float = 0.0  # per device, for MFU; 0 = measure a float32 matmul at start-up
    data: DataConfig = DataConfig()
    # DeepSeek-V4's switch against loss spikes (report 4.2.3; train/anticipatory_routing.py)
    anticipatory_routing: AnticipatoryRoutingConfig = AnticipatoryRoutingConfig()

    def validate(self) -> None:
        super().validate()
        for name in ("steps", "batch_size", "max_consecutive_skips", "loss_chunk_size",
                     "eval_batches"):
            check_int(name, getattr(self, name), 1)
        check_int("seq_len", self.seq_len, 2)  # one token has no next token: nothing to learn
        for name in ("micro_batch_size", "schedule_offset", "schedule_steps"):
            check_int(name, getattr(self, name), 0)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("loss_mask", self.loss_mask, LOSS_MASKS)
        if not isinstance(self.init_from, str):
            raise ConfigError("init_from", f"must be a checkpoint path or '', got {self.init_from!r}")
        for name in ("min_lr", "mtp_loss_weight", "balance_loss_coef", "router_bias_rate",
                     "sequence_balance_coef", "indexer_loss_coef", "peak_flops"):
            check_nonnegative(name, getattr(self, name))
        if self.schedule == "cosine" and self.min_lr > self.lr:
            raise ConfigError("min_lr", f"the cosine decays from train.lr={self.lr} down to "
                              f"min_lr, so min_lr must not exceed it; got {self.min_lr}")
        self._validate_span()
        self._validate_batch_warmup()
        self._validate_micro_batch()
        self._validate_stages()
        for i, w in enumerate(self.mtp_offset_weights):
            check_nonnegative(f"mtp_offset_weights[{i}]", w)
        if self.mtp_loss_weight_at_decay is not None:
            check_nonnegative("mtp_loss_weight_at_decay", self.mtp_loss_weight_at_decay)
            if decay_start(**self.schedule_settings()) is None:
                raise ConfigError("mtp_loss_weight_at_decay", "the learning rate never decays; "
                                  "use a cosine with min_lr < lr or a lower lr_stages end")
        if self.trainable == "indexer" and self.router_bias_rate:
            raise ConfigError("router_bias_rate", "must be 0 under train.trainable=indexer")
        check_periodic(self)

    def _validate_batch_warmup(self) -> None:
        previous = -1
        for i, entry in enumerate(self.batch_warmup):
            if (not isinstance(entry, (list, tuple)) or len(entry) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)):
                raise ConfigError(f"batch_warmup[{i}]", f"expected [until_step, batch_size] "
                                  f"integers, got {entry!r}")
            if entry[0] <= previous or entry[1] < 1:
                raise ConfigError(f"batch_warmup[{i}]", f"steps must increase and batch "
                                  f"sizes be >= 1, got {entry!r}")
            previous = entry[0]

    def _validate_micro_batch(self) -> None:
        micro = self.micro_batch()
        if self.micro_batch_size and self.batch_size % micro:
            raise ConfigError("micro_batch_size", f"must divide train.batch_size="
                              f"{self.batch_size} (a step accumulates batch_size / "
                              f"micro_batch_size micro-batches), got {micro}")
        named = (f"train.micro_batch_size={micro}" if self.micro_batch_size else
                 f"the micro-batch {micro} (the smallest batch size: train.micro_batch_size=0)")
        for i, (_, size) in enumerate(self.batch_warmup):
            if size % micro:
                raise ConfigError(f"batch_warmup[{i}]", f"batch size {size} is not a multiple "
                                  f"of {named}")
        if self.batch_size % micro:
            raise ConfigError("batch_size", f"{self.batch_size} is not a multiple of {named}")

    def schedule_length(self) -> tuple[int, str]:
        """The whole schedule's steps, and the field that sets them."""
        if self.schedule_steps:
            return self.schedule_steps, "train.schedule_steps"
        return self.schedule_offset + self.steps, "train.steps"

    def _validate_span(self) -> None:
        total, named = self.schedule_length()
        if self.schedule_offset + self.steps > total:
            raise ConfigError("schedule_steps", f"train.schedule_offset={self.schedule_offset} + "
                              f"train.steps={self.steps} run past the schedule's {total} steps")
        if self.warmup_steps > total:  # every schedule starts with the warm-up
            raise ConfigError("warmup_steps", f"{self.warmup_steps} warm-up steps exceed "
                              f"{named}={total}; set train.warmup_steps <= {total} "
                              f"(or raise {named})")

    def _validate_stages(self) -> None:
        if self.schedule == "stages" and not self.lr_stages:
            raise ConfigError("lr_stages", "schedule 'stages' needs at least one "
                              "[steps, end_lr, shape] stage")
        for i, stage in enumerate(self.lr_stages):
            if not isinstance(stage, (list, tuple)) or len(stage) != 3:
                raise ConfigError(f"lr_stages[{i}]", f"expected [steps, end_lr, shape], "
                                  f"got {stage!r}")
            check_int(f"lr_stages[{i}].steps", stage[0], 1)
            check_nonnegative(f"lr_stages[{i}].end_lr", stage[1])
            check_choice(f"lr_stages[{i}].shape", stage[2], STAGE_SHAPES)
        covered, (total, named) = (self.warmup_steps + sum(s[0] for s in self.lr_stages),
                                   self.schedule_length())
        if self.schedule == "stages" and covered != total:
            lengths = " + ".join(str(stage[0]) for stage in self.lr_stages)
            raise ConfigError("lr_stages", f"train.warmup_steps={self.warmup_steps} + the stages' "
                              f"{lengths} = {covered} steps, but {named}={total}; make them add "
                              "up (a constant stage holds a rate)")

    def schedule_settings(self) -> dict[str, Any]:
        return {**super().schedule_settings(), "schedule": self.schedule, "min_lr": self.min_lr,
                "total_steps": self.schedule_length()[0], "stages": self.lr_stages,
                "offset": self.schedule_offset}

    def micro_batch(self) -> int:
        return self.micro_batch_size or min(self.batch_sizes())

    def batch_sizes(self) -> list[int]:
        return [self.batch_size, *(size for _, size in self.batch_warmup)]

    def batch_size_at(self, step: int) -> int:
        """Global batch size of optimizer step `step`: the first warm-up entry whose
        `until_step` lies beyond `step`, else `batch_size` (report 3.1 batch-size warm-up)."""
        for until_step, size in self.batch_warmup:
            if step < until_step:
                return size
        return self.batch_size


@dataclasses.dataclass(frozen=True)
class MeshConfig(Config):
    """Device mesh sizes (train/parallel/sharding.py, docs/parallelism.md); -1 takes the devices
    the other axes leave (at most one axis may say -1). Report 3.2 trained with pipeline 8,
    expert 8 and ZeRO-1 data parallelism.

    `zero1`: optimizer state is also sharded over `data` (params and gradients are not).
    """

    section = "mesh"

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    context: int = 1  # splits each sequence (context parallelism, model/parallel/context.py)
    tensor: int = 1
    pipeline: int = 1
    zero1: bool = True

    def validate(self) -> None:
        for name in MESH_AXES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
                raise ConfigError(name, f"must be a positive integer or -1, got {value!r}")
        if [getattr(self, n) for n in MESH_AXES].count(-1) > 1:
            raise ConfigError("", "at most one axis may be -1 (it takes the remaining devices)")
        check_bool("zero1", self.zero1)

    def axis_sizes(self, num_devices: int) -> dict[str, int]:
        """{axis: size} for `num_devices` devices, -1 resolved; raises if they do not fit."""
        sizes = {n: getattr(self, n) for n in MESH_AXES}
        fixed = 1
        for size in sizes.values():
            fixed *= size if size != -1 else 1
        for name, size in sizes.items():
            if size == -1:
                if num_devices % fixed:
                    raise ValueError(f"mesh: the fixed axes use {fixed} devices, which does not "
                                     f"divide the {num_devices} available")
                sizes[name] = num_devices // fixed
        total = 1
        for size in sizes.values():
            total *= size
        if total != num_devices:
            shown = " ".join(f"{n}={s}" for n, s in sizes.items() if s > 1) or "all 1"
            raise ValueError(f"mesh: {shown} needs {total} devices but {num_devices} are "
                             "available; set one axis to -1 to take the rest")
        return sizes


@dataclasses.dataclass(frozen=True)
class RunConfig(Config):
    """A training run: the model, its training and the device mesh; checks what spans them."""

    model: ModelConfig
    train: TrainConfig
    mesh: MeshConfig = MeshConfig()

    def validate(self) -> None:
        if self.train.trainable == "indexer" and "C" not in expand_layout(self.model.layout):
            raise ConfigError("train.trainable", "'indexer' needs a C layer in model.layout")
        if len(self.train.mtp_offset_weights) > self.model.mtp.num_heads:
            raise ConfigError("train.mtp_offset_weights", f"{len(self.train.mtp_offset_weights)} "
                              f"weights but the model has model.mtp.num_heads="
                              f"{self.model.mtp.num_heads}")
        # A micro-batch's tokens, and their routed expert slots, are indexed with int32.
        micro, length, top_k = self.train.micro_batch(), self.train.seq_len, self.model.moe.top_k
        if micro * length * top_k > INT32_MAX:
            raise ConfigError("train.seq_len", f"{micro} x {length} tokens per micro-batch x "
                              f"model.moe.top_k={top_k} = {micro * length * top_k:,} routed slots "
                              f"exceed int32 indexing ({INT32_MAX:,}); lower train.seq_len or "
                              "the micro-batch (train.micro_batch_size)")

    def to_dict(self) -> dict:
        return {"model": config_to_dict(self.model), "train": config_to_dict(self.train),
                "mesh": config_to_dict(self.mesh)}

    def trained_mtp_heads(self) -> int:
        """MTP heads that enter the loss: up to the last non-zero per-offset weight."""
        if not (self.train.mtp_loss_weight or self.train.mtp_loss_weight_at_decay):
            return 0
        weights = self.train.mtp_offset_weights[:self.model.mtp.num_heads]
        return max((i + 1 for i, w in enumerate(weights) if w > 0), default=0)


def run_config_from_dict(values: Mapping[str, Any]) -> RunConfig:
    check_sections(values, RUN_SECTIONS)
    return RunConfig(model=config_from_dict(values.get("model") or {}, "model."),
                     train=build_dataclass(TrainConfig, values.get("train") or {}, "train."),
                     mesh=build_dataclass(MeshConfig, values.get("mesh") or {}, "mesh."))


def load_run_config(path: str | Path, overrides: Sequence[str] = (),
                    model: Mapping[str, Any] | None = None) -> RunConfig:
    """Reads a run YAML (`model:` / `train:` / `mesh:` sections; a file without them is a model
    preset; one without a model takes `model`, the fields of `--init-from`'s model, or is
    refused) and applies `model.x=...` / `train.x=...` / `mesh.x=...` overrides."""
    values = read_yaml(path)
    check_run_yaml(values, path)
    if not (set(RUN_SECTIONS) & set(values)):
        values = {"model": values}
    values["model"] = (dict(model) if model is not None and "model" not in values
                       else model_values(values, path))
    check_override_sections(overrides, {"model": ModelConfig, "train": TrainConfig,
                                        "mesh": MeshConfig})
    fitted = fit_warmup(values, apply_overrides(values, overrides), overrides,
                        {"steps": TrainConfig.steps, "warmup_steps": TrainConfig.warmup_steps})
    return run_config_from_dict(fitted)


def check_sections(values: Mapping[str, Any], sections: Sequence[str]) -> None:
    """A run YAML holds only the top-level `sections`."""
    unknown = sorted(set(values) - set(sections), key=str)
    if unknown:
        raise ValueError(f"config: unknown top-level section(s) {unknown}"
                         f"{did_you_mean(str(unknown[0]), sections)}; "
                         f"expected {', '.join(sections)}")


def check_override_sections(overrides: Sequence[str], sections: Mapping[str, type]) -> None:
    """Every dotted override must start with one of the run YAML's sections ({name: its config
    class}); a key without one is told its spelling (`use model.layout=... here`)."""
    known = [name for section, cls in sections.items()
             for name in dotted_names(cls, f"{section}.")]
    for override in overrides:
        key, _, value = (part.strip() for part in override.partition("="))
        if key.split(".")[0] not in sections:
            prefixes = ", ".join(f"'{s}.'" for s in sections)
            held = [f"{s}.{key}" for s in sections if f"{s}.{key}" in known]
            hint = (f"; use {held[0]}={value} here" if held else
                    did_you_mean(key, known) or f", e.g. {next(iter(sections))}.{key}=...")
            raise ValueError(f"override {override!r}: prefix the key with one of {prefixes}"
                             f"{hint}")


def resume_changes(saved: Mapping[str, Any], run: RunConfig) -> list[str]:
    """Dotted fields in which `run` differs from the config a checkpoint was saved with and
    that a resumed run may not change. `saved` is read as this version reads it, so a field
    added since the checkpoint was written counts at its default (e.g. train.loss_mask: auto,
    which is `all` on the text data such a run could have)."""
    return incompatible_fields(run_config_from_dict(saved).to_dict(), run.to_dict())
