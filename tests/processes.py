"""Helpers for tests that run several processes of one job (multi-host, two-group, channels)."""

import os
import socket
import subprocess
import time

from grpo_jax import writers


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for a coordinator or a channel)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Waits for every process (stdout piped, text); returns their (returncode, output) pairs.
    Kills the ones still running when one fails or ``timeout`` s pass: one process failing
    leaves the others waiting on it (a collective, a key, a batch).

    Raises:
      subprocess.TimeoutExpired: a process ran past ``timeout``.
    """
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


def wait_for_training_row(workdir, step: int, procs: list[subprocess.Popen], timeout=240.0):
    """Waits until ``workdir``'s metrics.jsonl has the training row of step ``step`` (or later).

    Raises:
      AssertionError: a process ended first, or ``timeout`` s passed.
    """
    path, deadline = os.path.join(workdir, "metrics.jsonl"), time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = writers.read_jsonl(path) if os.path.exists(path) else []
        if any(r["step"] >= step and "loss" in r for r in rows):
            return
        assert all(p.poll() is None for p in procs), "a process ended before the step"
        time.sleep(0.05)
    raise AssertionError(f"no training row for step {step} in {timeout} s")
