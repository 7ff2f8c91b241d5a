"""Signals under load: SIGTERM and SIGINT at random moments of short runs, end to end.

One uninterrupted reference run, then chains of interrupted runs: each chain reruns the same
command in one workdir, every invocation but the last getting a signal (sometimes two) at a
random moment (seeded) after its handler is installed, until a rerun completes; the completed
run must equal the reference (metrics rows, evaluations, summary, final state). Meanwhile a
second process hammers the chain's workdir with the same command (refused: one ``error:`` line,
the lock's holder or the config difference named) and a CPU-burning neighbour loads the cores.

Checked for every invocation: the exit status is 0 (completed, or SIGTERM) or 130 (SIGINT),
matching the signal its one line names; never a signal death (a negative status, 139); no
traceback. Runtime: ~25 invocations of a 3-step smoke run (~10 s of CPU each, most of it
tracing), a few minutes on two cores; ``GRPO_JAX_STRESS_SIGNALS`` sets the number of signals.
"""

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from test_reliability import _Run
from test_train import deterministic_rows

from grpo_jax import writers

_ARGS = [
    "--config=configs/arithmetic.py:grpo,smoke",
    "--config.mesh.num_devices=1",
    "--config.logging.tensorboard=False",
    "--config.steps=3",
    "--config.checkpoint.every_steps=1",
    "--config.eval.every_steps=2",  # an evaluation inside the loop, and the final one
]
_HAMMER_ARGS = ["--config.seed=12345"]  # refused also when it gets the lock: another config
_SIGNALS = int(os.environ.get("GRPO_JAX_STRESS_SIGNALS", "32"))
_SEED = int(os.environ.get("GRPO_JAX_STRESS_SEED", "0"))
_MAX_INTERRUPTS = 6  # per chain: then a rerun without a signal completes it
_LOG_LINE = re.compile(r"^[IWEF]\d{4} ")  # absl / glog lines on stderr
_SAID = re.compile(r"^(SIGTERM|SIGINT)\b")  # the run's one line about the signal


def _caught(pid: int, signum: int) -> bool:
    """True when process ``pid`` has a handler for ``signum`` (/proc/<pid>/status SigCgt)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


class _Invocation(_Run):
    """One ``python -m experiments.run`` of `_ARGS` (output to files: no pipe can stall it)."""

    def __init__(self, workdir, env, extra=(), tag="run"):
        super().__init__(workdir, env, list(extra), tag, args=_ARGS)
        self.t0 = time.monotonic()
        self.sent: list[str] = []

    def wait_for_handler(self, timeout=300) -> float | None:
        """Seconds until the SIGTERM handler is installed; None if the process ended first."""
        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                return None
            if _caught(self.proc.pid, signal.SIGTERM):
                return time.monotonic() - self.t0
            time.sleep(0.005)
        raise AssertionError(f"no SIGTERM handler after {timeout} s")

    def signal(self, name) -> bool:
        if self.proc.poll() is not None:
            return False
        self.proc.send_signal(getattr(signal, name))
        self.sent.append(name)
        return True

    def sleep_while_alive(self, seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end and self.proc.poll() is None:
            time.sleep(min(0.01, max(end - time.monotonic(), 0)))

    def wait(self, timeout=3600) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def _problems(inv: _Invocation, rc: int) -> list[str]:
    """What is wrong with one finished invocation (empty: nothing)."""
    out, err = inv.out, inv.err
    said = [l for l in (out + "\n" + err).splitlines() if _SAID.match(l)]
    problems = []
    if rc < 0 or (rc > 128 and rc != 130):
        problems.append(f"killed by a signal or crashed (exit status {rc})")
    elif rc not in (0, 130):
        problems.append(f"exit status {rc}")
    if "Traceback" in out + err:
        problems.append("a traceback")
    if len(said) > 1:
        problems.append(f"{len(said)} signal lines: {said}")
    if said and rc in (0, 130):
        want = 130 if said[0].startswith("SIGINT") else 0
        if rc != want:
            problems.append(f"exit status {rc} after {said[0]!r}")
    if not said and rc == 130:
        problems.append("exit status 130 without a line saying why")
    if problems:
        problems.append(f"signals {inv.sent}; stdout {out[-1500:]!r}; stderr {err[-3000:]!r}")
    return problems


class _Hammer(threading.Thread):
    """Starts the same command (another seed) on ``target`` while ``busy`` holds a live run,
    one process at a time; records each refusal's exit status and error line."""

    def __init__(self, env, rng):
        super().__init__(daemon=True)
        self.env, self.rng = env, rng
        self.target = None  # (workdir, live _Invocation)
        self.idle = threading.Event()
        self.idle.set()
        self.stop = threading.Event()
        self.results: list[tuple[int, str, str]] = []

    def run(self):
        n = 0
        while not self.stop.is_set():
            target = self.target
            if target is None or target[1].proc.poll() is not None:
                time.sleep(0.05)
                continue
            workdir, _ = target
            if not os.path.exists(os.path.join(workdir, "config.json")):
                time.sleep(0.05)
                continue
            self.idle.clear()
            try:
                n += 1
                inv = _Invocation(workdir, self.env, _HAMMER_ARGS, tag=f"hammer{n}")
                rc = inv.wait()
                self.results.append((rc, inv.out, inv.err))
            finally:
                self.idle.set()
            time.sleep(self.rng.uniform(1.0, 3.0))


def _hammer_problems(rc, out, err) -> list[str]:
    lines = [l for l in err.splitlines() if l.strip() and not _LOG_LINE.match(l)]
    ok = (
        rc in (1, 2)
        and "Traceback" not in out + err
        and len(lines) == 1
        and lines[0].startswith("error: ")
        and ("is in use by another run (pid " in lines[0] or "with another config" in lines[0])
    )
    return [] if ok else [f"hammer: exit {rc}, stderr {err[-2000:]!r}, stdout {out[-500:]!r}"]


def _saved_state(workdir, step):
    import warnings

    import orbax.checkpoint as ocp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sharding info not provided")
        return ocp.PyTreeCheckpointer().restore(
            os.path.join(workdir, "checkpoints", str(step), "state")
        )


def _same_run(reference, workdir) -> list[str]:
    import jax

    a, b = deterministic_rows(str(reference)), deterministic_rows(str(workdir))
    if a != b:
        return [f"{workdir}: metrics rows differ from the reference"]
    sa = json.load(open(os.path.join(reference, "summary.json")))
    sb = json.load(open(os.path.join(workdir, "summary.json")))
    if sa["eval_after"] != sb["eval_after"] or sa["data"] != sb["data"]:
        return [f"{workdir}: summary differs from the reference"]
    ta, tb = _saved_state(reference, 3), _saved_state(workdir, 3)
    same = jax.tree.structure(ta) == jax.tree.structure(tb) and all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(ta), jax.tree.leaves(tb))
    )
    return [] if same else [f"{workdir}: final state differs from the reference"]


@pytest.mark.slow
def test_signals_at_random_moments_under_load_exit_cleanly_and_reruns_equal_the_reference(
    tmp_path,
):
    rng = np.random.default_rng(_SEED)
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    hammer = _Hammer(env, np.random.default_rng(_SEED + 1))
    t_start = time.monotonic()
    problems, log = [], []
    try:
        reference = tmp_path / "reference"
        ref = _Invocation(reference, env, tag="reference")
        ready = ref.wait_for_handler()
        rc = ref.wait()
        assert rc == 0 and (reference / "summary.json").exists(), (rc, ref.err[-3000:])
        # handler installed -> exit: the moments are drawn in [0, 0.9 span]; span shrinks to the
        # shortest rerun that completed without a signal (the reference compiled, they do not)
        span = time.monotonic() - ref.t0 - (ready or 0.0)
        hammer.start()

        signals, chain = 0, 0
        while signals < _SIGNALS:
            chain += 1
            workdir = tmp_path / f"chain{chain}"
            for i in range(_MAX_INTERRUPTS + 2):
                hammer.idle.wait()  # the chain's runs never race a hammer for the lock
                inv = _Invocation(workdir, env, tag=f"run{i}")
                hammer.target = (str(workdir), inv)
                interrupt = i < _MAX_INTERRUPTS and signals < _SIGNALS
                ready = inv.wait_for_handler()
                delay = float(rng.uniform(0, 0.9 * span))
                if interrupt and ready is not None:
                    inv.sleep_while_alive(delay)
                    signals += inv.signal(str(rng.choice(["SIGTERM", "SIGINT"])))
                    if inv.sent and rng.uniform() < 0.5:  # a second one, in the teardown
                        inv.sleep_while_alive(float(rng.uniform(0, 1.0)))
                        signals += inv.signal(str(rng.choice(["SIGTERM", "SIGINT"])))
                rc = inv.wait()
                hammer.target = None
                hammer.idle.wait()  # a hammer started meanwhile has ended too
                done = (workdir / "summary.json").exists()
                if rc == 0 and not inv.sent and ready is not None and done:
                    span = min(span, time.monotonic() - inv.t0 - ready)  # a cached run's length
                log.append((chain, i, round(delay, 2), inv.sent, rc))
                problems += _problems(inv, rc)
                if done:
                    break
            else:
                problems.append(f"{workdir}: no rerun completed")
                continue
            problems += _same_run(reference, workdir)
            if not problems:
                shutil.rmtree(workdir)  # keep only what failed
    finally:
        hammer.stop.set()
        if hammer.is_alive():
            hammer.join(timeout=900)
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the runs and hammers, waited for
        burner.kill()
        burner.wait()
    for rc, out, err in hammer.results:
        problems += _hammer_problems(rc, out, err)
    elapsed = time.monotonic() - t_start
    print(
        f"{signals} signals, {len(log)} interrupted/resumed runs in {chain} chains, "
        f"{len(hammer.results)} refused hammer runs, {elapsed:.0f} s wall, "
        f"{usage.ru_utime + usage.ru_stime:.0f} s CPU in the runs and hammers; "
        f"runs (chain, rerun, delay s, signals, exit): {log}"
    )
    assert signals >= _SIGNALS
    assert hammer.results, "the hammer never ran"
    assert not problems, "\n".join(problems)
    rows = writers.read_jsonl(str(reference / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
