"""A sandboxed Python tool for tool-integrated RL: model-written code runs in a fresh interpreter
with CPU-time, memory, output and wall-clock limits, no network, no processes and no files
outside a fresh temporary directory; whatever happens comes back as a `ToolResult`, never as an
exception in the training process.

The layers (each one alone would not do):

* a new interpreter per call (``python -I -S``: stdlib only, no site-packages, no user paths,
  cwd and ``HOME`` = a fresh temporary directory, a minimal environment), in its own session, so
  a wall-clock timeout kills its whole process group;
* resource limits it sets on itself before the code runs: ``RLIMIT_CPU`` (CPU seconds),
  ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (bytes per file, which also caps stdout and
  stderr: they go to files), ``RLIMIT_NOFILE``, no core files;
* a network namespace of its own (``unshare(CLONE_NEWNET)``, as root or with unprivileged user
  namespaces): no interface but a down loopback; ``ToolResult.network_isolated`` says whether
  the kernel allowed it;
* a PEP 578 audit hook, installed before the code runs (and not removable): sockets, processes
  (``subprocess``, ``os.system``, ``os.exec*``, ``fork``), signals to other processes, ``ctypes``
  and file operations outside the temporary directory (reads of the standard library excepted)
  raise ``PermissionError``.

This is the isolation RL frameworks use for model-written code on a training host (cf.
OpenAI's human-eval ``reliability_guard`` and rlimits); it is not a boundary against a
determined adversary (audit hooks are not a security mechanism, Python's docs say so): for
untrusted users' code use a container or gVisor/nsjail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# The child: limits on itself, its own network namespace, the audit hook, then the code. Its
# arguments: limits as JSON, then the code's path. Runs under ``python -I -S``.
_CHILD = r"""
import ctypes, json, os, resource, sys
lim = json.loads(sys.argv[1]); code_path = sys.argv[2]; home = os.getcwd()
try:  # CLONE_NEWNET, else CLONE_NEWUSER | CLONE_NEWNET (unprivileged user namespaces)
    libc = ctypes.CDLL(None, use_errno=True)
    iso = libc.unshare(0x40000000) == 0 or libc.unshare(0x10000000 | 0x40000000) == 0
except OSError:
    iso = False
open(os.path.join(home, ".net"), "w").write("1" if iso else "0")
cpu = max(1, int(lim["cpu_seconds"] + 0.999))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"], lim["memory_bytes"]))
resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_bytes"], lim["file_bytes"]))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
source = open(code_path).read()
os.remove(code_path)
stdlib = os.path.dirname(os.__file__) + os.sep
inside = home + os.sep
BLOCK = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.fork",
         "os.forkpty", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.",
         "os.startfile", "_posixsubprocess")
PATH_ARGS = {"open": 0, "os.listdir": 0, "os.scandir": 0, "os.chdir": 0, "os.remove": 0,
             "os.rmdir": 0, "os.mkdir": 0, "os.rename": 0, "os.link": 0, "os.symlink": 0,
             "os.truncate": 0, "os.chmod": 0, "os.chown": 0, "os.utime": 0, "shutil.rmtree": 0,
             "os.chroot": 0, "glob.glob": 0}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def _where(p):
    if isinstance(p, int):
        return None  # an already open descriptor: only stdin/out/err and our own files are open
    p = os.fsdecode(p)
    return os.path.realpath(p if os.path.isabs(p) else os.path.join(home, p))

def hook(event, args):
    if event.startswith(BLOCK):
        raise PermissionError(f"the sandbox does not allow {event}")
    if event in PATH_ARGS and args:
        path = _where(args[PATH_ARGS[event]])
        if path is None or (path + os.sep).startswith(inside):
            return
        reading = event in ("open", "os.listdir", "os.scandir", "glob.glob") and (
            event != "open" or (not set(str(args[1] or "")) & set("wax+")
                                and not (args[2] or 0) & WRITE_FLAGS))
        if reading and path.startswith(stdlib):
            return
        raise PermissionError(f"the sandbox allows no file access outside its directory: {path}")

sys.addaudithook(hook)
del ctypes, libc
exec(compile(source, "<tool>", "exec"), {"__name__": "__main__"})
"""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits. ``cpu_seconds``: CPU time (s; rounded up to a whole second, the kernel's
    unit); ``wall_seconds``: wall clock (s), then the process group is killed; ``memory_bytes``:
    address space; ``output_bytes``: stdout / stderr kept (bytes; more is cut, not an error);
    ``file_bytes``: the largest file the code may write, stdout and stderr included (bytes)."""

    cpu_seconds: float = 5.0
    wall_seconds: float = 10.0
    memory_bytes: int = 1 << 30
    output_bytes: int = 4096
    file_bytes: int = 16 << 20

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"SandboxLimits.{f.name} must be > 0; got {getattr(self, f.name)}")


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What one call produced. ``status``: ``ok`` | ``error`` (the code raised or exited
    non-zero; ``stderr`` has the traceback) | ``timeout`` (wall clock) | ``cpu_limit`` |
    ``memory_limit`` | ``output_limit`` (a file or the output grew past ``file_bytes``)."""

    status: str
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float
    network_isolated: bool

    def observation(self) -> str:
        """The text the policy sees next: the output, then what went wrong (the last line of a
        traceback: ``ValueError: boom``), or the limit that stopped it."""
        out = self.stdout
        if self.status == "error":
            lines = [x for x in self.stderr.strip().splitlines() if x.strip()]
            out += (lines[-1] if lines else f"exit code {self.returncode}") + "\n"
        elif self.status != "ok":
            out += f"[{self.status.replace('_', ' ')}]\n"
        return out


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> ToolResult:
    """Runs ``code`` in the sandbox (module docstring) and returns what happened; raises nothing
    for anything the code does. Safe to call from a multithreaded (JAX) process: the child sets
    its own limits after ``exec``, no ``preexec_fn``."""
    home = tempfile.mkdtemp(prefix="grpo_jax_tool_")
    try:
        code_path = os.path.join(home, ".code.py")
        with open(code_path, "w") as f:
            f.write(code)
        env = {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        lim = dataclasses.asdict(limits)
        t0 = time.monotonic()
        with (
            open(os.path.join(home, ".stdout"), "wb") as out,
            open(os.path.join(home, ".stderr"), "wb") as err,
        ):
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _CHILD, json.dumps(lim), code_path],
                cwd=home,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=limits.wall_seconds)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc, timed_out = proc.wait(), True
        seconds = time.monotonic() - t0
        stdout, stderr = (
            _read(os.path.join(home, n), limits.output_bytes) for n in (".stdout", ".stderr")
        )
        net = _read(os.path.join(home, ".net"), 1) == "1"
        return ToolResult(_status(rc, timed_out, stderr), stdout, stderr, rc, seconds, net)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _status(rc: int, timed_out: bool, stderr: str) -> str:
    if timed_out:
        return "timeout"
    if rc in (-signal.SIGXCPU, -signal.SIGKILL):  # soft then hard RLIMIT_CPU
        return "cpu_limit"
    if rc == -signal.SIGXFSZ or (rc != 0 and "File too large" in stderr):  # Python ignores SIGXFSZ
        return "output_limit"
    if rc != 0 and "MemoryError" in stderr:
        return "memory_limit"
    return "ok" if rc == 0 else "error"


def _read(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""
