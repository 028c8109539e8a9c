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

import contextlib
import json
import os
import socket
import time
from typing import Any, Sequence

import jax
import numpy as np

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_CPU_COLLECTIVES = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"
DEFAULT_TIMEOUT_S = 300.0  # how long the processes may take to reach the coordinator
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
               *, timeout_seconds: float = DEFAULT_TIMEOUT_S) -> bool:
    """Starts `jax.distributed` if a multi-process run is asked for (see the module doc);
    returns whether it did. Call it before anything touches devices (jax.devices(), arrays).
    With an explicit coordinator, every process must reach it within `timeout_seconds`
    (`rendezvous`), else DistributedError."""
    coordinator, num_processes, process_id, start = resolve(coordinator, num_processes,
                                                            process_id)
    if not start:
        return False
    if not timeout_seconds > 0:
        raise DistributedError(f"--coordinator-timeout must be > 0 seconds, got {timeout_seconds}")
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
    if coordinator is not None and num_processes is not None and process_id is not None:
        rendezvous(coordinator, num_processes, process_id, timeout_seconds)
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   local_device_ids=local_device_ids,
                                   initialization_timeout=max(1, int(timeout_seconds)))
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


def rendezvous(coordinator: str, num_processes: int, process_id: int, timeout: float) -> None:
    """Waits until every process has reached process 0 at `coordinator`, or raises
    DistributedError naming who did not within `timeout` seconds. JAX's own start-up would
    wait as long, then abort every process with a C++ stack dump. Process 0 listens on the
    coordinator's port and closes it when all have come, before JAX's coordination service
    takes the port; each other process connects, says its id and waits for the go-ahead."""
    host, _, port = coordinator.rpartition(":")
    deadline = time.monotonic() + timeout
    if process_id == 0:
        _gather(int(port), num_processes, deadline, coordinator, timeout)
    else:
        _report(host.strip("[]"), int(port), process_id, deadline, coordinator, timeout)


def _gather(port: int, num_processes: int, deadline: float, coordinator: str,
            timeout: float) -> None:
    """Process 0's side of `rendezvous`."""
    try:  # every interface, IPv6 too where it can, as JAX's service listens
        dual = socket.has_dualstack_ipv6()
        server = socket.create_server(("", port), family=socket.AF_INET6 if dual else
                                      socket.AF_INET, dualstack_ipv6=dual)
    except OSError as err:
        raise DistributedError(f"process 0 cannot listen on port {port} of --coordinator "
                               f"{coordinator} ({err.strerror or err}); choose a free port") \
            from None
    peers: dict[int, socket.socket] = {}
    try:
        while len(peers) < num_processes - 1:
            server.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                connection, _ = server.accept()
                connection.settimeout(max(0.01, deadline - time.monotonic()))
                said = connection.makefile().readline().strip()
            except (socket.timeout, OSError):
                said, connection = "", None
            if connection is not None and said.isdigit() and 0 < int(said) < num_processes \
                    and int(said) not in peers:
                peers[int(said)] = connection
            elif connection is not None:
                connection.close()  # a stray connection, or an id already seen
            if time.monotonic() >= deadline and len(peers) < num_processes - 1:
                missing = sorted(set(range(1, num_processes)) - set(peers))
                raise DistributedError(
                    f"process(es) {', '.join(map(str, missing))} of {num_processes} did not "
                    f"reach the coordinator {coordinator} within {timeout:g} s; start every "
                    "process (the same command with --process-id 0.."
                    f"{num_processes - 1}), or raise --coordinator-timeout")
        for connection in peers.values():
            connection.sendall(b"go\n")
        for connection in peers.values():  # they hang up first: the port is free at once
            connection.settimeout(5)
            with contextlib.suppress(OSError):
                connection.recv(1)
    finally:
        for connection in peers.values():
            connection.close()
        server.close()


def _report(host: str, port: int, process_id: int, deadline: float, coordinator: str,
            timeout: float) -> None:
    """The side of `rendezvous` of a process other than 0."""
    while True:
        try:
            connection = socket.create_connection(
                (host, port), timeout=max(0.01, min(5.0, deadline - time.monotonic())))
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"process {process_id} could not reach the coordinator {coordinator} "
                    f"(process 0) within {timeout:g} s; start process 0 there (the same "
                    "command with --process-id 0), check the address, or raise "
                    "--coordinator-timeout") from None
            time.sleep(0.2)
    with connection:
        try:
            connection.settimeout(max(0.01, deadline - time.monotonic()))
            connection.sendall(f"{process_id}\n".encode())
            answer = connection.makefile().readline().strip()
        except OSError:
            answer = ""
    if answer != "go":
        raise DistributedError(
            f"process {process_id}: the coordinator {coordinator} did not see every process "
            f"within {timeout:g} s (or another service listens there); start all processes "
            "together, or raise --coordinator-timeout")


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
