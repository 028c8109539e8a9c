"""Multi-process (multi-host) start-up: one JAX process per host, all of them in one mesh.

    multi = initialize(coordinator, num_processes, process_id)   # before anything touches devices

Where the settings come from, first match wins per setting:
- the arguments (`python -m train --coordinator HOST:PORT --num-processes N --process-id I`);
- the environment variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (JAX reads
  only the first itself; the other two are read here);
- a cluster JAX detects (SLURM `srun`, Open MPI `mpirun`, Cloud TPU pods, Kubernetes jobs), with
  more than one process.
None of them: a single-process run, `jax.distributed` is not started. `--num-processes 1` forces a
single-process run inside a cluster allocation.

On CPU the processes exchange collectives over TCP with gloo (`jax_cpu_collectives_implementation`,
unless the environment variable JAX_CPU_COLLECTIVES_IMPLEMENTATION chose another, e.g. "mpi").
Two limits of CPU multi-process in JAX 0.10 shape what happens here:
- gloo connects the processes of a collective lazily, at its first use, and gives up (error or
  hang) if they arrive there more than ~30 s apart; `--xla_cpu_collective_timeout_seconds` does
  not extend this. So the processes must reach the first step within 30 s of each other.
- JAX's persistent compilation cache keys CPU executables by a per-process topology fingerprint
  and only process 0 writes entries, so on a warm cache process 0 loads the train step in
  seconds while the others compile it for minutes, which breaks the 30 s limit. `initialize`
  therefore turns the persistent cache off for multi-process CPU runs (all processes compile,
  in about the same time); GPU/TPU runs keep it.

Per-process values the checkpoint must hold for every process (each process reads its own
shard of the data, so each has its own data-iterator position) go through
`gather_process_states` when saving and `process_state` when restoring.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import jax
import numpy as np

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_CPU_COLLECTIVES = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"
PROCESSES_KEY = "processes"  # gather_process_states: {"processes": [state of process 0, ...]}


class DistributedError(ValueError):
    """Inconsistent multi-process settings, or `jax.distributed` could not start; one line."""


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name} must be an integer, got {value!r}") from None


def _check_address(address: str, source: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"{source}: expected HOST:PORT (e.g. 10.0.0.1:1234), "
                               f"got {address!r}")


def detected_cluster() -> tuple[str, int | None] | None:
    """(name, process count or None if unknown) of the cluster JAX would auto-detect, or None.
    Uses JAX's own detectors (jax._src.clusters), so it recognises what `initialize()` does."""
    try:
        from jax._src import clusters
        candidates = [env for env in clusters.ClusterEnv._cluster_types
                      if not getattr(env, "opt_in_only_method", False)]
    except (ImportError, AttributeError):  # private API moved: let JAX decide alone
        return None
    for env in candidates:
        try:
            if not env.is_env_present():
                continue
        except Exception:  # a detector that cannot run here (e.g. no metadata server)
            continue
        try:
            count = int(env.get_process_count())
        except Exception:
            count = None
        return getattr(env, "name", env.__name__), count
    return None


def resolve(coordinator: str | None, num_processes: int | None, process_id: int | None
            ) -> tuple[str | None, int | None, int | None, bool]:
    """-> (coordinator, num_processes, process_id, start): the explicit settings (arguments,
    then environment variables; None = let JAX detect them from the cluster) and whether
    `jax.distributed` should start. Raises DistributedError for inconsistent settings."""
    flags = {"--coordinator": coordinator, "--num-processes": num_processes,
             "--process-id": process_id}
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR, "").strip() or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    where = lambda flag, env: flag if flags[flag] is not None else env  # noqa: E731
    if num_processes is not None and num_processes < 1:
        raise DistributedError(f"{where('--num-processes', ENV_NUM_PROCESSES)} must be >= 1, "
                               f"got {num_processes}")
    if process_id is not None and process_id < 0:
        raise DistributedError(f"{where('--process-id', ENV_PROCESS_ID)} must be >= 0, "
                               f"got {process_id}")
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise DistributedError(
            f"process id {process_id} ({where('--process-id', ENV_PROCESS_ID)}) must be below the "
            f"number of processes {num_processes} ({where('--num-processes', ENV_NUM_PROCESSES)})")
    if coordinator is not None:
        _check_address(coordinator, where("--coordinator", ENV_COORDINATOR))
    if num_processes == 1:  # explicitly one process: nothing to coordinate
        return coordinator, 1, 0, False
    explicit = (coordinator, num_processes, process_id)
    if all(v is None for v in explicit):
        cluster = detected_cluster()
        return None, None, None, cluster is not None and cluster[1] != 1
    if None in explicit:
        cluster = detected_cluster()
        if cluster is None:
            missing = [f"{flag} (or {env})" for (flag, env), v in zip(
                (("--coordinator", ENV_COORDINATOR), ("--num-processes", ENV_NUM_PROCESSES),
                 ("--process-id", ENV_PROCESS_ID)), explicit) if v is None]
            raise DistributedError(f"multi-process run: also set {' and '.join(missing)}; no "
                                   "cluster (SLURM, Open MPI, TPU pod, Kubernetes) was detected "
                                   "to supply them")
    return coordinator, num_processes, process_id, True


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids: Sequence[int] | None = None,
               *, timeout_seconds: int = 300) -> bool:
    """Starts `jax.distributed` if a multi-process run is asked for (see the module doc);
    returns whether it did. Call it before anything touches devices (jax.devices(), arrays)."""
    coordinator, num_processes, process_id, start = resolve(coordinator, num_processes,
                                                            process_id)
    if not start:
        return False
    if jax.distributed.is_initialized():
        raise DistributedError("jax.distributed is already initialised in this process")
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        raise DistributedError("multi-process set-up must happen before JAX uses any device "
                               "(initialize() was called too late)")
    if not os.environ.get(ENV_CPU_COLLECTIVES):
        # Cross-process collectives of the CPU backend; without them a CPU mesh spanning
        # processes fails at the first all-reduce. No effect on GPU/TPU backends.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   local_device_ids=local_device_ids,
                                   initialization_timeout=timeout_seconds)
    except (RuntimeError, ValueError, TypeError) as err:
        who = (f"process {process_id} of {num_processes}" if process_id is not None
               else "this process")
        reason = " ".join(str(err).split())[:300]
        where = coordinator or "auto-detected"
        raise DistributedError(f"jax.distributed.initialize failed for {who} "
                               f"(coordinator {where}): {reason}") from None
    if jax.process_count() > 1 and jax.default_backend() == "cpu":
        jax.config.update("jax_enable_compilation_cache", False)  # see the module doc
    return True


def is_lead() -> bool:
    """The process that writes files shared by all (metrics, summaries)."""
    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """True on every process if `flag` is True on any of them (a collective: every process must
    call it). Lets all processes stop at the same step when one receives SIGTERM."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils
    return bool(np.asarray(multihost_utils.process_allgather(np.int32(bool(flag)))).max())


def from_lead(value: int | None) -> int | None:
    """Process 0's `value` on every process (a collective), e.g. the step to resume from, so
    that processes reading a lagging shared filesystem cannot disagree."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils
    shared = int(multihost_utils.broadcast_one_to_all(np.int64(-1 if value is None else value)))
    return None if shared < 0 else shared


# ---- per-process state in checkpoints ----------------------------------------------------------


def gather_process_states(local: Any) -> Any:
    """Every process's JSON-serialisable `local` state, gathered on all processes (a collective:
    every process must call it). Single process: `local` unchanged (the checkpoint format of
    single-process runs); else {"processes": [state of process 0, 1, ...]}."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils
    encoded = np.frombuffer(json.dumps(local, sort_keys=True).encode(), dtype=np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int32(encoded.size)))
    # Round the padded size up so a slowly growing state does not recompile every save.
    width = -(-int(lengths.max()) // 4096) * 4096
    padded = np.zeros(width, np.uint8)
    padded[:encoded.size] = encoded
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return {PROCESSES_KEY: [json.loads(bytes(row[:n]).decode())
                            for row, n in zip(rows, lengths.reshape(-1))]}


def process_state(saved: Any) -> Any:
    """This process's entry of a `gather_process_states` result. A state saved by a different
    number of processes raises DistributedError; a single-process state is returned as is."""
    if not (isinstance(saved, dict) and set(saved) == {PROCESSES_KEY}):
        return saved
    states = saved[PROCESSES_KEY]
    if len(states) != jax.process_count():
        raise DistributedError(f"the checkpoint was written by {len(states)} processes, this run "
                               f"has {jax.process_count()}; resume with {len(states)} processes")
    return states[jax.process_index()]
