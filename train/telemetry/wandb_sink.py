"""Weights & Biases logging of a run's scalars (`train.wandb.project=NAME`, `rl.wandb.project`;
the `wandb` extra: `pip install 'stepjax[wandb]'`).

The run is named after the workdir unless `name` says otherwise, carries the resolved run config,
and keeps its W&B id in `WORKDIR/wandb_run_id`: a resumed workdir continues the same W&B run
(`resume="allow"`). Steps a resume repeats (those after its checkpoint) keep the values W&B
received first, since W&B takes each step once. Everything W&B reads from the environment works
as usual: `WANDB_MODE=offline` writes the run under `WORKDIR/wandb/` for a later `wandb sync`,
`WANDB_API_KEY`, `WANDB_BASE_URL`. Only scalars go to W&B; histograms stay in TensorBoard.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from model.config import Config, ConfigError
from model.interop.atomic_file import write_text_atomically

RUN_ID_FILE = "wandb_run_id"


@dataclasses.dataclass(frozen=True)
class WandbConfig(Config):
    """Off while `project` is empty. `entity`: the W&B team or user ("" = the account's
    default); `name`: the run's display name ("" = the workdir's name)."""

    project: str = ""
    entity: str = ""
    name: str = ""

    def validate(self) -> None:
        for field in dataclasses.fields(self):
            if not isinstance(getattr(self, field.name), str):
                raise ConfigError(field.name, f"must be a string, got "
                                  f"{getattr(self, field.name)!r}")


def check_wandb(config: WandbConfig, section: str) -> None:
    """W&B logging asked for (`<section>.wandb.project`) needs the package: a ValueError naming
    the extra, before any work."""
    if not config.project:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ValueError(f"{section}.wandb.project: logging to Weights & Biases needs the wandb "
                         "package: pip install 'stepjax[wandb]' (or leave the field empty)"
                         ) from None


class WandbSink:
    """A `MetricsWriter` sink (train/telemetry/metrics.py): `log` runs on the writer's thread."""

    def __init__(self, config: WandbConfig, workdir: Path, run_values: Mapping[str, Any]):
        import wandb

        id_file = Path(workdir) / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None  # None: a new run
        self.run = wandb.init(project=config.project, entity=config.entity or None,
                              name=config.name or Path(workdir).resolve().name, id=run_id,
                              resume="allow", dir=str(workdir), config=dict(run_values))
        if run_id is None:
            write_text_atomically(id_file, self.run.id + "\n")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_sinks(config: WandbConfig, workdir: Path,
                run_values: Mapping[str, Any]) -> list[WandbSink]:
    """[the W&B sink] when `config.project` is set, else []."""
    return [WandbSink(config, workdir, run_values)] if config.project else []
