"""Helpers for tests that run several processes of one job (multi-host, two-group, channels)."""

import socket
import subprocess


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
