"""Joining a multi-process JAX job (TPU pod slices, Slurm / MPI GPU jobs, hosts by hand).

`initialize(...)` wraps `jax.distributed.initialize`: explicit coordinator flags or the
GRPO_JAX_COORDINATOR / GRPO_JAX_NUM_PROCESSES / GRPO_JAX_PROCESS_ID environment, or JAX's own
cluster detection (TPU VM workers, Slurm, Open MPI). Used by `experiments/run.py` (its
`--distributed`, `--coordinator_address`, `--num_processes`, `--process_id` flags). After it,
`jax.devices()` lists every process's devices; the data design that goes with it is in
`grpo_jax.experiment.Experiment.to_device` / `to_host`.
"""

from __future__ import annotations

import os
import threading
import time

import jax
from jax._src import distributed as _jax_distributed  # the key-value client; nowhere public


class JoinError(RuntimeError):
    """Not every process joined the job in time (or joining failed): one line."""


def _detected_cluster() -> str | None:
    """The multi-process cluster JAX can configure itself from, if any."""
    env = os.environ
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return "TPU pod"
    if (
        int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")) or 1) > 1
        and "SLURM_JOB_ID" in env
    ):
        return "Slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "Open MPI"
    return None


def job_settings(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> tuple[str | None, int | None, int | None]:
    """(coordinator, num_processes, process_id): the flags' values, each missing one from the
    environment (GRPO_JAX_COORDINATOR, GRPO_JAX_NUM_PROCESSES, GRPO_JAX_PROCESS_ID), else None."""
    env = os.environ
    coordinator = coordinator or env.get("GRPO_JAX_COORDINATOR") or None
    if num_processes is None and env.get("GRPO_JAX_NUM_PROCESSES"):
        num_processes = int(env["GRPO_JAX_NUM_PROCESSES"])
    if process_id is None and env.get("GRPO_JAX_PROCESS_ID"):
        process_id = int(env["GRPO_JAX_PROCESS_ID"])
    return coordinator, num_processes, process_id


def initialize(
    mode: str = "auto",
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    timeout_s: int = 300,
    heartbeat_timeout_s: int = 100,
    recoverable: bool = False,
) -> bool:
    """Joins this process to a multi-process JAX job; returns whether it did.

    Args:
      mode: "auto" (join when a coordinator is given or `_detected_cluster` finds a multi-process
        TPU pod / Slurm / Open MPI job), "on" (always; JAX auto-detects the cluster when no
        coordinator is given), "off" (never).
      coordinator: "HOST:PORT" of process 0's coordinator service.
      num_processes, process_id: the job's size and this process's index in [0, num_processes).
      timeout_s: seconds to wait for every process to join (the coordinator, then the devices'
        topology) before raising `JoinError` (instead of hanging). JAX's own deadline is set
        later than this one: past it JAX aborts the process (SIGABRT, a stack dump).
      heartbeat_timeout_s: seconds without a process's heartbeat before the job counts it dead.
      recoverable: a dead process leaves the job (``jax_enable_recoverability``) instead of
        aborting every other process; the two-group run's processes watch each other
        (`grpo_jax.disaggregated.Peer`).

    Flags win over the environment (GRPO_JAX_COORDINATOR, GRPO_JAX_NUM_PROCESSES,
    GRPO_JAX_PROCESS_ID). Must run before anything touches a JAX device.

    The join runs in a thread while the calling (main) thread waits in short slices, so the
    process's Python signal handlers run during it (JAX's join is one blocking call).

    Raises:
      ValueError: a coordinator without the process count / id (or the reverse).
      JoinError: the job was not joined within ``timeout_s``, or joining failed.
    """
    coordinator, num_processes, process_id = job_settings(coordinator, num_processes, process_id)
    if mode == "off":
        return False
    explicit = coordinator is not None
    if explicit and (num_processes is None or process_id is None):
        raise ValueError(
            "--coordinator_address needs --num_processes and --process_id (or "
            "GRPO_JAX_NUM_PROCESSES / GRPO_JAX_PROCESS_ID)"
        )
    if not explicit and (num_processes is not None or process_id is not None) and mode == "auto":
        raise ValueError(
            "--num_processes / --process_id need --coordinator_address (or GRPO_JAX_COORDINATOR)"
        )
    cluster = _detected_cluster()
    if mode == "auto" and not explicit and cluster is None:
        return False

    if not jax.config.jax_cpu_collectives_implementation:
        jax.config.update(
            "jax_cpu_collectives_implementation", "gloo"
        )  # CPU cross-process collectives
    jax.config.update("jax_enable_recoverability", recoverable)
    kwargs = {  # JAX's deadline after ours: ours is one line, JAX's an abort
        "initialization_timeout": timeout_s + 60,
        "heartbeat_timeout_seconds": heartbeat_timeout_s,
    }
    if explicit:
        kwargs.update(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
        )
    _join(kwargs, timeout_s, f"{num_processes or 'the'} processes")
    how = f"coordinator {coordinator}" if explicit else (cluster or "auto-detected")
    print(
        f"process {jax.process_index()}/{jax.process_count()} ({how}): "
        f"{jax.local_device_count()} local / {jax.device_count()} global devices",
        flush=True,
    )
    return True


def coordination_client():
    """The key-value client of this process's `jax.distributed` coordination service.

    JAX keeps it in a private module (Orbax reads it from the same place); this is the one line
    in grpo_jax that reaches for it.

    Raises:
      RuntimeError: `jax.distributed.initialize` has not run in this process.
    """
    client = _jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed.initialize has not run in this process")
    return client


def _join(kwargs: dict, timeout_s: float, who: str) -> None:
    """`jax.distributed.initialize(**kwargs)` and the backend's start (every process's devices:
    another wait for all of them), in a thread; the main thread waits in slices (its signal
    handlers run meanwhile).

    Raises:
      JoinError: not done within ``timeout_s``, or either step raised.
    """
    failed: list[BaseException] = []

    def join():
        try:
            jax.distributed.initialize(**kwargs)
            jax.devices()  # the topology exchange: waits for every process too
        except BaseException as e:  # told to the main thread
            failed.append(e)

    thread = threading.Thread(target=join, name="join-job", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(0.25)
    if thread.is_alive():
        raise JoinError(
            f"not every one of {who} joined the job within --distributed_timeout_s={timeout_s:g} "
            "s (one not started, or stopped while joining); nothing was run"
        )
    if failed:
        message = " ".join(str(failed[0]).split())
        raise JoinError(f"joining the job of {who} failed: {message}") from failed[0]
