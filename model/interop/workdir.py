"""The on-disk layout of a training workdir: orbax checkpoints
`DIR/checkpoints/<step>/{state,data,config}`.

`state` is the `TrainState` pytree (params, optimizer state, step, RNG, skip counters), `data`
the grain iterator position (JSON) and `config` the resolved `RunConfig` (JSON). An RL workdir
(`python -m rl`) has the same layout around its own state, whose `actor` is the policy's
`TrainState` (`WORKDIR_KINDS`), so a model loads from either. Saves are
asynchronous (the blocking part only copies arrays to host) and keep the last K steps; orbax
writes into a temporary directory and renames it when complete, so an interrupted save never
replaces a good checkpoint.

It lives with the model because a model loads from a workdir as from any other checkpoint
format (`model.weights.load_model`); the trainer writes it (`train.loop`).
"""

from pathlib import Path
from typing import Any, Mapping, NamedTuple

import jax
import orbax.checkpoint as ocp

from model.interop.io_errors import os_reason
from model.interop.orbax_quiet import quiet_background_failures


class WorkdirKind(NamedTuple):
    """What the checkpoints of one command's workdirs hold."""

    command: str
    model_state: tuple[str, ...]  # where the model's TrainState lies in the `state` item
    tokenizer: tuple[str, ...]  # where the saved run config names the tokenizer


WORKDIR_KINDS = {
    "train": WorkdirKind("python -m train", (), ("train", "data", "tokenizer")),
    "rl": WorkdirKind("python -m rl", ("actor",), ("rl", "tokenizer")),  # the policy
}


def workdir_kind(run: Mapping[str, Any]) -> str:
    """The command that saved run config `run` (a checkpoint's `config` item)."""
    return "rl" if "rl" in run else "train"


def saved_tokenizer(run: Mapping[str, Any]) -> str:
    """The tokenizer (`train.data.tokenizer` spec) a saved run config trained with."""
    value: Any = run
    for key in WORKDIR_KINDS[workdir_kind(run)].tokenizer:
        value = value[key]
    return value


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be read (corrupt, truncated or of another layout), or one
    could not be written (a full disk)."""


class Checkpointer:
    def __init__(self, directory: Path, keep: int):
        self.directory = Path(directory).absolute()
        quiet_background_failures()  # a failed save or restore is reported once, by this class
        # create=False: the directory appears with the first save, so a run that fails before
        # it (or a reader such as train.eval) leaves no empty checkpoints/ behind.
        self._manager = ocp.CheckpointManager(
            self.directory, item_names=("state", "data", "config"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=False,
                                                 enable_async_checkpointing=True))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict, config: dict) -> None:
        """Starts an asynchronous save; a failure of the previous one is raised here (or by
        `wait`/`close`) as a CheckpointError."""
        try:
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                config=ocp.args.JsonSave(config)), force=True)
        except Exception as err:  # orbax wraps OS errors in ValueError and others
            raise CheckpointError(self._save_failed(err)) from None

    def delete_after(self, step: int) -> None:
        """Deletes the checkpoints of the steps after `step` (a rollback discards them)."""
        for later in self.all_steps():
            if later > step:
                self._manager.delete(later)

    def read_config(self, step: int) -> dict:
        try:
            return self._manager.restore(step, args=ocp.args.Composite(
                config=ocp.args.JsonRestore()))["config"]
        except Exception as err:  # orbax raises many types for damaged files
            raise CheckpointError(self._unreadable(step, err)) from None

    def restore_subset(self, step: int, target: Any) -> Any:
        """Only the leaves of the `state` item that `target` names (orbax partial restore),
        e.g. {"params": ..., "balance": ...} without the optimizer state."""
        state_dir = self.directory / str(step) / "state"
        try:
            with ocp.PyTreeCheckpointer() as checkpointer:
                restored = checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(
                    item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                    partial_restore=True))
        except Exception as err:  # orbax raises many types for damaged or foreign files
            raise CheckpointError(self._unreadable(step, err)) from None
        # A leaf the checkpoint does not hold comes back as its target, unread.
        missing = [jax.tree_util.keystr(path) for path, leaf in
                   jax.tree_util.tree_flatten_with_path(restored)[0]
                   if isinstance(leaf, jax.ShapeDtypeStruct)]
        if missing:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} holds no "
                                  f"{missing[0]} ({len(missing)} leaves missing)")
        return restored

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """-> (state with the structure/dtypes of `abstract_state`, data-iterator state)."""
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except Exception as err:
            raise CheckpointError(self._unreadable(step, err)) from None
        _check_shapes(restored["state"], abstract_state, self.directory / str(step))
        return restored["state"], restored["data"]

    def wait(self) -> None:
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            raise CheckpointError(self._save_failed(err)) from None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()

    def _save_failed(self, err: Exception) -> str:
        self._manager.reload()  # forget the failed step: list what is complete on disk
        kept = self._manager.latest_step()
        intact = (f"the checkpoints up to step {kept} are intact" if kept is not None
                  else "no checkpoint was saved yet")
        return (f"saving a checkpoint in {self.directory} failed ({os_reason(err)}); {intact}: "
                "free disk space and re-run the same command to resume")

    def _unreadable(self, step: int, err: Exception) -> str:
        reason = " ".join(str(err).split()).split(" See full TensorStore details")[0][:200]
        return (f"checkpoint {self.directory / str(step)} is unreadable or corrupt "
                f"({type(err).__name__}: {reason}); move it away to resume from an earlier one")


def latest_checkpoint_step(workdir: Path) -> int | None:
    """Latest checkpointed step of a `python -m train` workdir (None: nothing saved yet)."""
    if not (Path(workdir) / "checkpoints").is_dir():
        return None
    checkpoints = Checkpointer(Path(workdir) / "checkpoints", keep=1 << 30)
    try:
        return checkpoints.latest_step()
    finally:
        checkpoints.close()


def latest_run_config(workdir: Path, step: int | None = None) -> tuple[int, dict]:
    """(step, resolved run config dict) of the newest checkpoint of a `python -m train` or
    `python -m rl` workdir, or of its checkpoint of `step` (CheckpointError listing the saved
    steps if it has none of that step)."""
    checkpoints = Checkpointer(Path(workdir) / "checkpoints", keep=1 << 30)
    try:
        saved = checkpoints.all_steps()
        if not saved:
            raise CheckpointError(f"no checkpoint in {checkpoints.directory}")
        if step is not None and step not in saved:
            raise CheckpointError(f"{checkpoints.directory / str(step)}: no checkpoint of step "
                                  f"{step}; saved steps: {', '.join(map(str, saved))}")
        step = saved[-1] if step is None else step
        return step, checkpoints.read_config(step)
    finally:
        checkpoints.close()


def split_checkpoint_step(path: Path) -> tuple[Path, int | None]:
    """A checkpoint named by its step directory, `DIR/checkpoints/<step>` -> (DIR, step): how
    every command that reads weights takes a step other than a workdir's latest. Any other
    path -> (path, None)."""
    path = Path(path)
    if path.parent.name == "checkpoints" and path.name.isdigit():
        return path.parent.parent, int(path.name)
    return path, None


def restore_target(abstract: Any, shardings: Any) -> Any:
    """`abstract` (a tree of ShapeDtypeStructs) with shardings attached, what `restore` reads
    into: `shardings` is a matching tree or one sharding for every leaf (e.g. a single device,
    to read a checkpoint whatever mesh or process count saved it)."""
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, abstract)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)


def _check_shapes(restored: Any, expected: Any, where: Path) -> None:
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(restored)[0],
                                 jax.tree.leaves(expected)):
        if got.shape != want.shape:
            raise CheckpointError(f"checkpoint {where}: {jax.tree_util.keystr(path)} has shape "
                                  f"{got.shape}, the model expects {want.shape}")
