"""A run's outputs while it runs, for `python -m train` and `python -m rl` alike: the metrics
writer (metrics.jsonl, TensorBoard and, when configured, Weights & Biases), the progress display
and the start-up line that says what is being trained where.

    with run_outputs(workdir, run.train, run.to_dict(), total=240, initial=0, desc="train",
                     unit="step", lead=True) as (writer, progress):
        progress.notice(startup_line("train", run.model, mesh, "2,048 tokens per step (8 x 256)"))
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import jax

from model.config import ModelConfig
from model.config.cli import human
from model.summary import count_params
from train.telemetry.metrics import DiscardingWriter, MetricsWriter
from train.telemetry.progress import Progress
from train.telemetry.wandb_sink import wandb_sinks


@contextlib.contextmanager
def run_outputs(workdir: Path, loop: Any, run_values: Mapping[str, Any], *, total: int,
                initial: int, desc: str, unit: str, lead: bool = True
                ) -> Iterator[tuple[MetricsWriter | DiscardingWriter, Progress]]:
    """(writer, progress) of a run whose loop settings are `loop` (a `LoopConfig`: log_every,
    progress, wandb); `run_values`: the resolved config W&B records. Only the `lead` process
    writes and prints."""
    writer = (MetricsWriter(workdir, sinks=wandb_sinks(loop.wandb, workdir, run_values))
              if lead else DiscardingWriter())
    with writer, Progress(total, initial, every=loop.log_every, desc=desc, unit=unit,
                          show=loop.progress, lead=lead) as progress:
        yield writer, progress


def startup_line(desc: str, model: ModelConfig, mesh: jax.sharding.Mesh, work: str) -> str:
    """`train: 7.64 M parameters, 5.28 M active per token (MTP heads included); 8 cpu devices,
    mesh data=4 expert=2; 2,048 tokens per step (8 x 256)`. Parameters as `python -m
    model.summary` counts them ("with MTP"), from shapes only (model.lm's cached trace)."""
    counts = count_params(model)["with_mtp"]
    devices = mesh.devices.size
    platform = mesh.devices.flat[0].platform
    axes = " ".join(f"{name}={size}" for name, size in mesh.shape.items() if size > 1)
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    return (f"{desc}: {human(counts['total'])} parameters, {human(counts['active'])} active per "
            f"token (MTP heads included); {devices} {platform} device{'s' * (devices != 1)}"
            f"{processes}, mesh {axes or 'of one device'}; {work}")


def token_count_line(sizes: Sequence[int], seq_len: int, unit: str, what: str = "") -> str:
    """`2,048 tokens per step (8 x 256)`; with a batch-size warm-up `512 -> 2,048 tokens per
    step (2 -> 8 x 256)`; `what` goes before the count (`generated at most`)."""
    return (f"{what + ' ' if what else ''}{' -> '.join(f'{size * seq_len:,}' for size in sizes)}"
            f" tokens per {unit} ({' -> '.join(map(str, sizes))} x {seq_len})")
