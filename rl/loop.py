"""The RL loop (report 5.2): `RLTrainer` iterations (rl/trainer.py) to `rl.iterations`, with
held-out evaluations, metrics, checkpoints, resume and stop signals.

    summary = run_rl(run, workdir, init_from="runs/sft_arith")

Metrics go to `DIR/metrics.jsonl`, TensorBoard and W&B if configured (`rl.wandb.project`), the
resolved config to `DIR/config.yaml`; checkpoints (actor and critic with
optimizer states, the reference policy) to `DIR/checkpoints/<iteration>/`. Re-running the same
command resumes. Everything runs under `rl.mesh` with training's layouts (rl/parallel.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from model.interop.workdir_lock import claimed_workdir
from model.parallel.rules import use_mesh
from rl.config import RLRunConfig
from rl.trainer import RLState, RLTrainer
from train.interrupts import stop_requests
from train.loop import enable_compilation_cache
from train.run_record import write_run_config
from train.telemetry.metrics import METRICS_FILE, read_metrics
from train.telemetry.outputs import run_outputs, startup_line, token_count_line
from train.telemetry.wandb_sink import check_wandb


@dataclasses.dataclass
class RLSummary:
    workdir: Path
    first_iteration: int
    last_iteration: int
    accuracy_before: float | None  # held-out greedy accuracy of the initial policy (iteration 0)
    accuracy_after: float | None  # ... at the last evaluation of this invocation
    interrupted: bool


def _initial_accuracy(workdir: Path) -> float | None:
    """The held-out accuracy of the initial policy, as a resumed run's metrics recorded it."""
    path = workdir / METRICS_FILE
    records = read_metrics(path) if path.is_file() else []
    return next((r["eval/accuracy"] for r in records if r["step"] == 0
                 and r.get("eval/accuracy") is not None), None)


def run_rl(run: RLRunConfig, workdir: Path, *, init_from: str | None = None,
           stop_after: int | None = None, devices: list | None = None) -> RLSummary:
    """Runs to `rl.iterations`, resuming from `workdir`'s latest checkpoint. `stop_after`:
    leave (with a checkpoint) after this many iterations, as SIGTERM would (tests). `devices`:
    those `rl.mesh` spans (default: all). Everything runs under the mesh (rl/parallel.py)."""
    enable_compilation_cache(run.rl.xla_cache_dir)
    check_wandb(run.rl.wandb, "rl")
    with claimed_workdir(Path(workdir)):
        trainer = RLTrainer(run, Path(workdir), init_from, devices)
        try:
            with use_mesh(trainer.mesh):
                state = trainer.initial_state()
                # The model resolved (--init-from's or the checkpoint's), a resume's checkpoint
                # restored, and iterations left: only a run that trains rewrites its record.
                if int(state.iteration) < trainer.run.rl.iterations:
                    write_run_config(trainer.workdir, trainer.run.to_dict(), "python -m rl")
                return _iterate(trainer, state, stop_after)
        finally:
            trainer.checkpoints.close()


def _iterate(trainer: RLTrainer, state: RLState, stop_after: int | None) -> RLSummary:
    rl = trainer.run.rl
    first = iteration = saved = int(state.iteration)
    before = after = None
    interrupted = False
    outputs = run_outputs(trainer.workdir, rl, trainer.run.to_dict(), total=rl.iterations,
                          initial=first, desc="rl", unit="it")
    with outputs as (writer, progress), stop_requests() as stop:
        progress.notice(startup_line("rl", trainer.run.model, trainer.mesh, token_count_line(
            [rl.batch_size], rl.max_new_tokens, "iteration", "generated at most")))
        writer.truncate_after(first)
        if first == 0:
            scores = trainer.evaluate(state)
            writer.write(0, scores)
            progress.notice(f"iteration 0: held-out accuracy {scores['eval/accuracy']:.3f} "
                            f"(greedy), {scores['eval/sample_accuracy']:.3f} (sampled)")
        before = _initial_accuracy(trainer.workdir) if first else scores["eval/accuracy"]
        while iteration < rl.iterations:
            state, metrics = trainer.iteration(state, iteration)
            iteration += 1
            if rl.eval_every and iteration % rl.eval_every == 0 or iteration == rl.iterations:
                metrics.update(trainer.evaluate(state))
                after = metrics["eval/accuracy"]
                progress.notice(f"iteration {iteration}: held-out accuracy {after:.3f} (greedy), "
                                f"{metrics['eval/sample_accuracy']:.3f} (sampled)")
            if iteration % rl.log_every == 0 or "eval/accuracy" in metrics:
                writer.write(iteration, metrics)
            progress.update(iteration, {"reward": metrics["reward"],
                                        "keep": metrics["token_keep_frac"]})
            if stop["signal"] is not None or (stop_after is not None
                                              and iteration - first >= stop_after):
                interrupted = True
                break
            if iteration % rl.checkpoint_every == 0:
                trainer.save(state)
                saved = iteration
        if iteration != saved:
            trainer.save(state)
    return RLSummary(trainer.workdir, first, iteration, before, after, interrupted)
