"""The training loop: set-up, resume, the step loop, logging, checkpoints, clean shutdown.

    summary = train(run, workdir)

Re-running with the same workdir resumes from the latest checkpoint and reproduces exactly the
losses of an uninterrupted run (state, data position and RNG are all in the checkpoint).
"""

import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from model.interop.workdir import Checkpointer, restore_target
from model.interop.workdir_lock import claimed_workdir
from model.parallel.rules import use_mesh
from model.tokenizers.chat import chat_tokenizer_for
from model.tokenizers.text import load_tokenizer
from model.weights import load_model
from train.anticipatory_routing import AnticipatoryRouting, check_anticipatory_routing
from train.checkpoint import check_training_checkpoint
from train.compiled_step import jit_train_step, step_layout
from train.config import RunConfig, resume_changes
from train.data.pipeline import make_dataset
from train.data.sources import check_data, open_data
from train.init_from import check_init_source, fitted_variables
from train.interrupts import stop_requests
from train.parallel.distributed import (
    any_process,
    from_lead,
    gather_process_states,
    is_lead,
    process_state,
)
from train.parallel.sharding import check_batch_fits, make_mesh
from train.periodic import PeriodicEvals
from train.periodic_config import reads_heldout
from train.run_record import check_and_record, write_run_config
from train.state import TrainState, create_state, state_from_variables
from train.telemetry.mfu import measure_matmul_peak, train_flops_per_token
from train.telemetry.outputs import run_outputs, startup_line, token_count_line
from train.telemetry.throughput import CompletedSteps
from train.telemetry.wandb_sink import check_wandb


class TrainingError(RuntimeError):
    """A run cannot start or continue; the message is one line for the user."""


@dataclasses.dataclass
class TrainSummary:
    workdir: Path
    first_step: int  # step the run started from (0, or the resumed checkpoint's)
    last_step: int
    losses: list[float]  # loss of every step this invocation ran
    skipped: int
    interrupted: bool


def meta_loss_masked(switch_after_tokens: int, tokens_seen: int) -> bool:
    """Report A.3: metadata tokens leave the loss once `tokens_seen` reaches the switch point
    (`train.data.meta_loss_mask_after_tokens`; -1 = never)."""
    return 0 <= switch_after_tokens <= tokens_seen


def enable_compilation_cache(directory: str) -> None:
    """Points JAX's persistent compilation cache at `directory` unless it is "" or the process
    already chose a cache (e.g. the test suite's)."""
    if directory and jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(Path(directory).expanduser()))


def tokens_before(run: RunConfig, step: int) -> int:
    """Training tokens consumed by steps [0, step) under the batch-size warm-up."""
    return sum(run.train.batch_size_at(s) for s in range(step)) * run.train.seq_len


class Trainer:
    """Holds the pieces of one run; `train()` below is the entry point (it prepares and locks
    the workdir first)."""

    def __init__(self, run: RunConfig, workdir: Path, allow_data_change: bool = False):
        self.run, self.workdir = run, Path(workdir)
        self.checkpoints = Checkpointer(self.workdir / "checkpoints", run.train.keep_checkpoints)
        self.resume_step = from_lead(self.checkpoints.latest_step())
        if self.resume_step is not None:
            saved = self.checkpoints.read_config(self.resume_step)
            check_training_checkpoint(saved, self.workdir, "use another --workdir")
            changed = resume_changes(saved, run)
            if changed:
                raise TrainingError(
                    f"cannot resume {self.workdir}: the config differs from the checkpoint's in "
                    f"{', '.join(changed)}; use another --workdir or restore those values")
        self.mesh = make_mesh(run.mesh)
        check_batch_fits(run, self.mesh)
        if run.train.anticipatory_routing.enabled:
            try:
                check_anticipatory_routing(run.model, run.mesh.pipeline)
            except ValueError as err:
                raise TrainingError(str(err)) from None
        self.tokenizer = load_tokenizer(run.train.data.tokenizer)
        if self.resume_step is None and run.train.init_from:  # before any data or model work
            note = check_init_source(run.train.init_from, run.model, self.tokenizer)
            if note and is_lead():
                print(note, file=sys.stderr)
        # Opened once (raw documents read, or prepared manifests and shard sizes checked): the
        # train stream and every held-out evaluation read it. Checked here, before any model
        # work, so bad or changed data fails in seconds.
        self.data_source = open_data(run.train.data, self.tokenizer)
        check_data(self.data_source, run.train.data, self.tokenizer, loss_mask=run.train.loss_mask,
                   heldout=reads_heldout(run.train), shard_count=jax.process_count())
        chat = chat_tokenizer_for(self.tokenizer) if self.data_source.renders_chats else None
        note = check_and_record(self.workdir, self.tokenizer, run.train.data, chat,
                                resuming=self.resume_step is not None,
                                allow_data_change=allow_data_change, write=is_lead(),
                                fingerprint=self.data_source.fingerprint)
        if note and is_lead():
            print(note, file=sys.stderr)
        vocab = self.tokenizer.get_vocab_size()
        if vocab > run.model.vocab_size:
            raise TrainingError(f"tokenizer has {vocab} tokens but model.vocab_size="
                                f"{run.model.vocab_size}; raise model.vocab_size")
        self.layout = step_layout(run, self.mesh)
        self.training, self.abstract_state = self.layout.training, self.layout.abstract_state
        self.state_sharding = self.layout.state_sharding
        self.batch_sharding = self.layout.batch_sharding
        self.anticipatory = None
        if run.train.anticipatory_routing.enabled:
            self.anticipatory = AnticipatoryRouting(
                run.train.anticipatory_routing, self.training.model, self.batch_sharding,
                self.workdir, is_lead())
        self.evals = PeriodicEvals(run, self.training.model, self.tokenizer, self.data_source,
                                   self.mesh)
        self.data = make_dataset(
            run.train.data, self.tokenizer, seq_len=run.train.seq_len,
            batch_size=run.train.micro_batch() // jax.process_count(), split="train",
            seed=run.train.seed, shard_index=jax.process_index(), shard_count=jax.process_count(),
            data=self.data_source, loss_mask=run.train.loss_mask)
        if self.resume_step is None:  # the first batch read, and bad data met, before compiling
            self.data.peek()

    def initial_state(self, start_from: dict | None = None, carry=None) -> TrainState:
        """A fresh state, created directly in its shardings, or the latest checkpoint restored
        into them (whatever mesh it was saved from). `start_from`: variables {"params",
        "balance"} a fresh state takes instead of a random init; `carry(self)`: {optimizer-state
        leaf index: array} replacing those of the new optimizer state (else all new)."""
        seed = self.run.train.seed
        if self.resume_step is not None:
            return self.restore(self.resume_step)
        model, optimizer = self.training.model, self.training.optimizer
        if start_from is None:
            return jax.jit(lambda: create_state(model, optimizer, seed),
                           out_shardings=self.state_sharding)()
        target = (self.abstract_state.params, self.abstract_state.balance)
        start_from = fitted_variables(start_from, target)
        key, entries = jax.random.split(jax.random.key(seed))[1], carry(self) if carry else {}
        return jax.jit(lambda v, e: state_from_variables(v, optimizer, key, e),
                       out_shardings=self.state_sharding, donate_argnums=1)(start_from, entries)

    def start_variables(self, start_from: Callable[[Mesh], dict] | None) -> dict | None:
        """What a new run starts from (None: a random init, or its checkpoint): the variables
        `start_from(mesh)` reads, else `train.init_from`'s weights, onto the mesh (read outside
        its context: unboxing there would constrain abstract values)."""
        if self.resume_step is not None:
            return None
        if start_from is not None:
            return start_from(self.mesh)
        source = self.run.train.init_from
        if not source:
            return None
        if is_lead():
            print(f"starting from the weights of {source}: new optimizer state, step 0")
        return load_model(source, self.mesh)[1]

    def restore(self, step: int) -> TrainState:
        """The checkpoint of `step` in the state's shardings; the data stream continues from
        its position (each process: its own data shard)."""
        state, data_state = self.checkpoints.restore(
            step, restore_target(self.abstract_state, self.state_sharding))
        self.data.set_state(process_state(data_state))
        return state

    def roll_back(self, before: int) -> tuple[TrainState, int] | None:
        """Back to the latest checkpoint of a step before `before`, whose later checkpoints are
        deleted -> (its state, its step), or None without one (anticipatory routing)."""
        self.checkpoints.wait()
        earlier = [s for s in self.checkpoints.all_steps() if s < before]
        target = from_lead(earlier[-1] if earlier else None)
        if target is None:
            return None
        self.checkpoints.delete_after(target)
        return self.restore(target), target

    def next_batch(self, step: int) -> tuple[dict, int]:
        """([num_micro, micro, T] global arrays for optimizer step `step` (batch-size warm-up),
        their number of tokens). Each process reads its own rows (train/data/pipeline.py)."""
        num_micro = self.run.train.batch_size_at(step) // self.run.train.micro_batch()
        try:
            micro = [next(self.data) for _ in range(num_micro)]
        except ValueError as err:  # a record the data thread could not encode: named there
            raise TrainingError(str(err)) from None  # (grain's note cut by DataIterator)
        local = {k: np.stack([m[k] for m in micro]) for k in micro[0]}
        top = int(local["tokens"].max())
        if top >= self.run.model.vocab_size or int(local["tokens"].min()) < 0:
            raise TrainingError(f"data at step {step} has token id {top} outside "
                                f"[0, model.vocab_size={self.run.model.vocab_size})")
        batch = {k: jax.make_array_from_process_local_data(self.batch_sharding, v)
                 for k, v in local.items()}
        return batch, local["tokens"].size * jax.process_count()

    def mixture_shares(self) -> dict[str, float]:
        """A mixture's realised share of this process's training rows, by source (metrics
        `data/mix/<source>`; rows hold equal tokens, so these are token shares)."""
        if not self.run.train.data.mixture:
            return {}
        return {f"data/mix/{k}": v for k, v in self.data.mixture_shares().items()}

    def train_step(self):
        """The jitted step, with the state and batch shardings fixed (trace it under
        `use_mesh(self.mesh)`); `python -m train.plan --measure` compiles the same one."""
        return jit_train_step(self.layout, self.run)

    def save(self, state: TrainState) -> None:
        self.checkpoints.save(int(state.step), state, gather_process_states(self.data.get_state()),
                              self.run.to_dict())


def train(run: RunConfig, workdir: Path, *, stop_after: int | None = None,
          start_from: Callable[[Mesh], dict] | None = None, carry=None,
          allow_data_change: bool = False) -> TrainSummary:
    """Trains to `run.train.steps`, resuming from `workdir` if it holds checkpoints.
    `stop_after`: leave (with a checkpoint) after this many steps of this invocation, as a
    SIGTERM would; used to test resumption. `start_from`, `carry`: see Trainer.start_variables
    and Trainer.initial_state (a recipe stage continuing the previous ones,
    train/experiments/recipe.py).
    `allow_data_change`: resume even though the data files changed since the run started
    (train/run_record.py)."""
    enable_compilation_cache(run.train.xla_cache_dir)
    check_wandb(run.train.wandb, "train")
    # Stop requests from here on: a Ctrl-C while the state is built or restored is acknowledged
    # and honoured after the first step, a second one exits at once (train/interrupts.py).
    with claimed_workdir(Path(workdir)), stop_requests() as stop:
        trainer = Trainer(run, Path(workdir), allow_data_change)
        try:
            start_from = trainer.start_variables(start_from)
            with use_mesh(trainer.mesh):
                return _run_steps(trainer, trainer.initial_state(start_from, carry), stop,
                                  stop_after)
        finally:
            trainer.checkpoints.close()


def _run_steps(trainer: Trainer, state: TrainState, stop: dict,
               stop_after: int | None) -> TrainSummary:
    run, cfg = trainer.run, trainer.run.train
    first_step = step = saved_step = int(state.step)
    # The step of the newest checkpoint known intact (None: none yet).
    intact = first_step if trainer.resume_step is not None else None
    if first_step >= cfg.steps:
        if int(state.consecutive_skips) >= cfg.max_consecutive_skips:
            raise TrainingError(
                f"the checkpoint of step {first_step} in {trainer.checkpoints.directory} ends "
                f"{int(state.consecutive_skips)} consecutive non-finite steps: the run "
                f"diverged, it did not finish; move checkpoints/{first_step} away to resume "
                "from an earlier one, or train again with a lower train.lr in a new --workdir")
        return TrainSummary(workdir=trainer.workdir, first_step=first_step, last_step=first_step,
                            losses=[], skipped=int(state.skipped), interrupted=False)
    if is_lead():  # the resume checked and its checkpoint restored: this run trains
        write_run_config(trainer.workdir, run.to_dict(), "python -m train")
    flops_per_token = train_flops_per_token(run.model, cfg.seq_len, run.trained_mtp_heads())
    peak = (cfg.peak_flops or measure_matmul_peak()) * jax.device_count()
    tokens_seen = tokens_before(run, first_step)
    losses, interrupted = [], False

    def check(metrics, timed_tokens: int) -> None:
        """Reads a finished step's metrics (one step late, so dispatch never waits on it)."""
        losses.append(float(metrics["loss"]))
        clock.finished(timed_tokens)
        progress.update(first_step + len(losses), {"loss/lm": metrics["loss/lm"]})
        raise_if_diverged(metrics, first_step + len(losses))

    def raise_if_diverged(metrics, last: int) -> None:
        """Stops the run when the steps up to `last` ended `train.max_consecutive_skips`
        non-finite ones in a row."""
        if int(metrics["consecutive_skips"]) >= cfg.max_consecutive_skips:
            kept = (f"the checkpoint of step {intact} is intact (resuming repeats the same "
                    "steps: lower train.lr in a new --workdir, or raise "
                    "train.max_consecutive_skips)" if intact is not None else
                    "no checkpoint was saved: lower train.lr and re-run")
            raise TrainingError(
                f"the run diverged: {cfg.max_consecutive_skips} consecutive steps had a "
                f"non-finite loss or gradient (up to step {last}); stopped "
                f"without saving its state; {kept}")

    anticipatory = trainer.anticipatory  # DeepSeek-V4's switch, or None
    # One process writes metrics and prints.
    with run_outputs(trainer.workdir, cfg, run.to_dict(), total=cfg.steps, initial=first_step,
                     desc="train", unit="step", lead=is_lead()) as (writer, progress):
        sizes = [size for _, size in cfg.batch_warmup] + [cfg.batch_size]  # warm-up first
        progress.notice(startup_line("train", run.model, trainer.mesh,
                                     token_count_line(sizes, cfg.seq_len, "step")))
        writer.truncate_after(first_step)
        step_fn = trainer.train_step()
        clock, pending = CompletedSteps(), None
        while step < cfg.steps:
            batch, batch_tokens = trainer.next_batch(step)
            if anticipatory is not None:
                batch = anticipatory.prepare(step, state, batch)
            mask_meta = meta_loss_masked(cfg.data.meta_loss_mask_after_tokens, tokens_seen)
            call_start = time.perf_counter()
            state, metrics = step_fn(state, batch, np.bool_(mask_meta))
            if anticipatory is not None:
                metrics = {**metrics, **anticipatory.metrics(step)}
            timed_tokens = batch_tokens
            if step == first_step:  # the first call compiled (or loaded from the cache) the step
                jax.block_until_ready(metrics)
                clock.restart()  # throughput counts the steps after this one
                timed_tokens = 0
                progress.notice(f"compiled and ran the first train step in "
                                f"{time.perf_counter() - call_start:.1f}s")
            step += 1
            tokens_seen += batch_tokens
            if pending is not None:
                check(*pending)
                spiked = first_step + len(losses) - 1  # the update whose loss was just read
                if anticipatory is not None and anticipatory.is_spike(spiked, losses[-1]):
                    rollback = trainer.roll_back(spiked + 1)
                    event = anticipatory.start_window(spiked + 1, losses[-1],
                                                      rollback[1] if rollback else step)
                    progress.notice(f"loss spike at step {spiked + 1} ({event['loss']:.4g}, "
                                    f"median {event['median']:.4g}): anticipatory routing "
                                    f"from step {event['rollback_to']} to "
                                    f"{event['active_until']}")
                    if rollback is not None:  # re-train from the checkpoint
                        state, step = rollback
                        writer.truncate_after(step)
                        first_step = min(first_step, step)
                        del losses[step - first_step:]
                        tokens_seen, saved_step, pending = tokens_before(run, step), step, None
                        intact = step
                        clock.restart()
                        continue
            pending = (metrics, timed_tokens)
            evaluate_now = cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps)
            sample_now = cfg.sample_every and (step % cfg.sample_every == 0 or step == cfg.steps)
            if step % cfg.log_every == 0 or step == cfg.steps or evaluate_now or sample_now:
                rate = clock.tokens_per_sec()
                record = {**metrics, "tokens_seen": tokens_seen, **trainer.mixture_shares()}
                if rate is not None:  # None until a step after the compiling one has finished
                    record.update(tokens_per_sec=rate, mfu=rate * flops_per_token / peak)
                    progress.update(first_step + len(losses), {"tok/s": rate})
                if evaluate_now or sample_now:
                    measured, lines = trainer.evals.run_at(state, step, held_out=evaluate_now,
                                                           samples=sample_now)
                    record.update(measured)
                    for line in lines:
                        progress.notice(line)
                    clock.restart()  # the evaluation waited for this step: leave it untimed
                    pending = (metrics, 0)
                writer.write(step, record)
            # Every process stops at the same step, whichever of them got the signal.
            if any_process(stop["signal"] is not None
                           or (stop_after is not None and step - first_step >= stop_after)):
                interrupted = True
                break
            if step % cfg.checkpoint_every == 0:
                # A state that ended the run's divergence is never saved: a re-run would find
                # it at the last step and call the run finished. (Its loss is still read one
                # step late, where a spike rolls back past this checkpoint.)
                raise_if_diverged(pending[0], step)
                # Rows lag the steps (the writer waits for their values): a kill after this
                # checkpoint must not lose rows a resume from it would not write again.
                writer.flush()
                trainer.save(state)
                saved_step = intact = step
        if pending is not None:
            check(*pending)
        if saved_step != step:
            writer.flush()
            trainer.save(state)
    return TrainSummary(workdir=trainer.workdir, first_step=first_step, last_step=step,
                        losses=losses, skipped=int(state.skipped), interrupted=interrupted)
