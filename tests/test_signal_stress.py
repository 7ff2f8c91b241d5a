"""Signals in every phase of short runs, under load, end to end.

One uninterrupted reference run, then chains of interrupted runs: each chain reruns the same
command in one workdir, every invocation but the last getting a signal until a rerun
completes; the completed workdir must equal the reference's in every file (`workdirs.differences`:
metrics, samples, summary, config, TensorBoard events, every checkpoint's state, metadata and
markers; only the timing fields named there are exempt). Meanwhile a second process tries the
same command (another seed) on the chain's workdir once per invocation (refused: one ``error:``
line, the lock's holder or the config difference named), and a CPU-burning neighbour (niced:
it takes the cores' idle time, not the other tests') loads the machine.

Coverage, proportional rather than long: SIGTERM and SIGINT each land at least once inside each
phase -- the warm start, sampling, the update, an evaluation (the "before" one, one inside the
loop, the final one), a checkpoint write and the restore of a resumed run -- at a random moment
of that phase (a seeded delay after the phase's n-th call starts, the n-th call drawn too); and
"anywhere": at a random moment after the handler is installed, sent from outside, as a user
would. Half of the signals are followed by a second one during the teardown. That is 14
signals (plus the second ones) in ~4 chains of a 3-step smoke run: measured, 19 invocations and
19 refused second processes in 5 chains, 253 s of CPU in all (user + sys, a 2-core AMD EPYC
VM; the compiles are the session's cached ones). The test it replaces drew 32 random moments
(~25 invocations, a second process every 1-3 s, an un-niced burner on a full core) and reached
the short phases only by chance. ``GRPO_JAX_STRESS_SEED`` changes the draws.

Checked for every invocation: the exit status is 0 (completed, or SIGTERM) or 130 (SIGINT),
matching the signal its one line names; never a signal death (a negative status, 139); no
traceback.
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
from test_train import REPO
from workdirs import differences

from grpo_jax import writers

_STEPS = 3
_ARGS = [
    "--config=configs/arithmetic.py:grpo,smoke",
    "--config.mesh.num_devices=1",
    f"--config.steps={_STEPS}",
    "--config.checkpoint.every_steps=1",
    "--config.eval.every_steps=2",  # an evaluation inside the loop, and the final one
]
_HAMMER_ARGS = ["--config.seed=12345"]  # refused also when it gets the lock: another config
_SEED = int(os.environ.get("GRPO_JAX_STRESS_SEED", "0"))
_MAX_INTERRUPTS = 6  # per chain: then a rerun without a signal completes it
_MAX_CHAINS = 10
# phase -> the longest delay (s) after the phase's call starts (a call that ends first is
# signalled as it returns)
_PHASES = {
    "warmstart": 0.5,
    "sampling": 0.3,
    "update": 0.2,
    "evaluation": 0.3,
    "checkpoint": 0.05,
    "restore": 0.05,
    "anywhere": None,  # from outside, at a random moment after the handler is installed
}
_MAX_NTH = 3  # a phase's n-th call: n in 1..min(this, the calls left)


def _calls_left(phase, last) -> int:
    """How many times a run resumed from checkpoint ``last`` (-1: none) calls ``phase``'s
    function (evaluations: the "before" one, after step 2 (every_steps=2), the final one)."""
    done = max(last, 0)
    return {
        "warmstart": int(last < 0),
        "restore": int(last >= 0),
        "sampling": _STEPS - done,
        "update": _STEPS - done,
        "checkpoint": _STEPS - last,  # checkpoint 0 too in a fresh run
        "evaluation": 3 if last < 0 else max(1, len({2, 3} & set(range(last + 1, _STEPS + 1)))),
        "anywhere": 1,
    }[phase]


# The run with a signal injected into one phase: the phase's n-th call starts a timer that
# sends the signal if the call is still running when it fires (else the call sends it as it
# returns), writes "<phase> <signal>" to the marker file, and maybe sends a second signal.
_INJECT = """
import dataclasses, os, runpy, signal, sys, threading
phase, nth, signame, delay, second, second_delay, marker = sys.argv[1:8]
nth, delay, second_delay = int(nth), float(delay), float(second_delay)
del sys.argv[1:8]
from grpo_jax import checkpointing, evaluation, steps, train
state = {"calls": 0, "inside": False, "sent": False}
lock = threading.Lock()

def send_second():
    threading.Event().wait(second_delay)
    os.kill(os.getpid(), getattr(signal, second))

def fire():
    with lock:
        if not state["inside"] or state["sent"]:
            return
        state["sent"] = True
        with open(marker, "w") as f:
            f.write(f"{phase} {signame}\\n")
        os.kill(os.getpid(), getattr(signal, signame))
    if second:
        threading.Thread(target=send_second, daemon=True).start()

def wrap(real, wait=False):
    def wrapped(*args, **kwargs):
        state["calls"] += 1
        armed = state["calls"] == nth
        if armed:
            with lock:
                state["inside"] = True
            timer = threading.Timer(delay, fire)
            timer.daemon = True
            timer.start()
        try:
            out = real(*args, **kwargs)
            if wait:  # a dispatched program: the phase lasts until its results are ready
                import jax
                jax.block_until_ready(out)
            return out
        finally:
            if armed:
                timer.cancel()
                fire()  # a phase shorter than the delay: at its end
                with lock:
                    state["inside"] = False
    return wrapped

if phase == "update":
    make = steps.make_steps
    steps.make_steps = lambda exp: (lambda f: dataclasses.replace(f, train=wrap(f.train, True)))(
        make(exp)
    )
else:
    module, name = {
        "warmstart": (steps, "supervised_warmstart"),
        "sampling": (train, "sample_round"),
        "evaluation": (evaluation, "evaluate"),
        "checkpoint": (checkpointing.Checkpointer, "save"),
        "restore": (checkpointing.Checkpointer, "restore_latest"),
    }[phase]
    setattr(module, name, wrap(getattr(module, name)))
sys.argv[0] = "experiments/run.py"
runpy.run_module("experiments.run", run_name="__main__", alter_sys=True)
"""
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
    """One ``python -m experiments.run`` of `_ARGS` (output to files: no pipe can stall it);
    ``inject``: `_INJECT`'s arguments (phase, n, signal, delay, second signal or "", its delay)."""

    def __init__(self, workdir, env, extra=(), tag="run", inject=None):
        self.t0 = time.monotonic()
        self.sent: list[str] = []
        self.marker = f"{workdir}.{tag}.landed"
        if inject is None:
            super().__init__(workdir, env, list(extra), tag, args=_ARGS)
            return
        self.out_path, self.err_path = f"{workdir}.{tag}.out", f"{workdir}.{tag}.err"
        args = [sys.executable, "-c", _INJECT, *map(str, inject), self.marker, *_ARGS]
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [*args, *extra, f"--workdir={workdir}"], cwd=REPO, env=env, stdout=out, stderr=err
            )

    def landed(self) -> str | None:
        """ "<phase> <signal>" when an injected signal was sent inside its phase."""
        if not os.path.exists(self.marker):
            return None
        with open(self.marker) as f:
            return f.read().strip()

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
    """Starts the same command (another seed) once on each live ``target`` run, after a random
    wait; records each refusal's exit status and error line."""

    def __init__(self, env, rng):
        super().__init__(daemon=True)
        self.env, self.rng = env, rng
        self.target = None  # (workdir, live _Invocation)
        self.idle = threading.Event()
        self.idle.set()
        self.stop = threading.Event()
        self.results: list[tuple[int, str, str]] = []

    def run(self):
        n, done = 0, None
        while not self.stop.is_set():
            target = self.target
            if target is None or target[1] is done or target[1].proc.poll() is not None:
                time.sleep(0.05)
                continue
            workdir, _ = target
            if _lock_holder(workdir) != target[1].proc.pid:  # not before the run holds the lock
                time.sleep(0.05)  # (a rerun's workdir has config.json before its run starts)
                continue
            self.idle.clear()
            try:
                n += 1
                time.sleep(self.rng.uniform(0.0, 2.0))
                if target[1].proc.poll() is not None:
                    continue
                done = target[1]
                inv = _Invocation(workdir, self.env, _HAMMER_ARGS, tag=f"hammer{n}")
                rc = inv.wait()
                self.results.append((rc, inv.out, inv.err))
            finally:
                self.idle.set()


def _lock_holder(workdir) -> int | None:
    """The pid written in ``<workdir>/.lock`` (None: no lock file, released, or mid-write)."""
    try:
        with open(os.path.join(workdir, ".lock")) as f:
            return int(json.loads(f.read())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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


def _last_checkpoint(workdir) -> int:
    d = workdir / "checkpoints"
    return max([int(n) for n in os.listdir(d) if n.isdigit()] if d.is_dir() else [], default=-1)


def _next_signal(todo, last, timed):
    """The first (phase, signal) of ``todo`` that a run resumed from checkpoint ``last`` can
    reach (a fresh run: the warm start's first; "anywhere" once a cached run was ``timed``)."""
    reachable = [x for x in todo if _calls_left(x[0], last) and (x[0] != "anywhere" or timed)]
    first = [x for x in reachable if x[0] == "warmstart"]
    return (first or reachable or [None])[0]


def _start(rng, workdir, env, tag, item, last):
    """An invocation of `_ARGS` with ``item``'s signal injected (None: none, or from outside)."""
    if item is None or item[0] == "anywhere":
        return _Invocation(workdir, env, tag=tag)
    phase, signame = item
    second = str(rng.choice(["SIGTERM", "SIGINT"])) if rng.uniform() < 0.5 else ""
    inject = (
        phase,
        int(rng.integers(1, min(_MAX_NTH, _calls_left(phase, last)) + 1)),
        signame,
        round(float(rng.uniform(0, _PHASES[phase])), 4),
        second,
        round(float(rng.uniform(0, 1.0)), 3),
    )
    inv = _Invocation(workdir, env, tag=tag, inject=inject)
    inv.sent = [signame] + [second] * bool(second)  # if it lands
    return inv


@pytest.mark.slow
def test_signals_in_every_phase_under_load_exit_cleanly_and_reruns_equal_the_reference(
    tmp_path,
):
    rng = np.random.default_rng(_SEED)
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # with the session's compilation cache
    burner = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(19)
    )
    hammer = _Hammer(env, np.random.default_rng(_SEED + 1))
    t_start = time.monotonic()
    todo = [(p, s) for p in _PHASES for s in ("SIGTERM", "SIGINT")]
    rng.shuffle(todo)
    todo = [tuple(x) for x in todo]
    problems, log, landed = [], [], []
    try:
        reference = tmp_path / "reference"
        ref = _Invocation(reference, env, tag="reference")
        ready = ref.wait_for_handler()
        rc = ref.wait()
        assert rc == 0 and (reference / "summary.json").exists(), (rc, ref.err[-3000:])
        # "anywhere": handler installed -> exit; the moments are drawn in [0, 0.9 span], span
        # the shortest rerun that completed without a signal (cached compiles; the reference
        # compiled, so "anywhere" waits for the first such rerun)
        span, timed = time.monotonic() - ref.t0 - (ready or 0.0), False
        hammer.start()

        chain = 0
        while todo and chain < _MAX_CHAINS:
            chain += 1
            workdir = tmp_path / f"chain{chain}"
            for i in range(_MAX_INTERRUPTS + 2):
                hammer.idle.wait()  # the chain's runs never race a hammer for the lock
                last = _last_checkpoint(workdir)
                item = _next_signal(todo, last, timed) if i < _MAX_INTERRUPTS else None
                inv = _start(rng, workdir, env, f"run{i}", item, last)
                hammer.target = (str(workdir), inv)
                ready = inv.wait_for_handler()
                delay = None
                if item is not None and item[0] == "anywhere" and ready is not None:
                    delay = float(rng.uniform(0, 0.9 * span))
                    inv.sleep_while_alive(delay)
                    if inv.signal(item[1]):
                        landed.append(item)
                        if rng.uniform() < 0.5:  # a second one, in the teardown
                            inv.sleep_while_alive(float(rng.uniform(0, 1.0)))
                            inv.signal(str(rng.choice(["SIGTERM", "SIGINT"])))
                rc = inv.wait()
                hammer.target = None
                hammer.idle.wait()  # a hammer started meanwhile has ended too
                if item is not None and item[0] != "anywhere":
                    if inv.landed() == " ".join(item):
                        landed.append(item)
                    else:
                        inv.sent = []  # the phase was not reached: no signal
                if item in landed and item in todo:
                    todo.remove(item)
                done = (workdir / "summary.json").exists()
                if rc == 0 and not inv.sent and ready is not None and done:
                    span = min(span, time.monotonic() - inv.t0 - ready)  # a cached run's length
                    timed = True
                log.append((chain, i, item, delay, inv.sent, rc))
                problems += _problems(inv, rc)
                if done:
                    break
            else:
                problems.append(f"{workdir}: no rerun completed")
                continue
            problems += differences(reference, workdir)
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
        f"{len(landed)} signals landed in their phase ({sum(len(x[4]) for x in log)} sent), "
        f"{len(log)} runs in {chain} chains, {len(hammer.results)} refused hammer runs, "
        f"{elapsed:.0f} s wall, {usage.ru_utime + usage.ru_stime:.0f} s CPU in the runs and "
        f"hammers; runs (chain, rerun, (phase, signal), outside delay s, sent, exit): {log}"
    )
    assert not todo, f"never landed: {todo}"
    assert hammer.results, "the hammer never ran"
    assert not problems, "\n".join(problems)
    rows = writers.read_jsonl(str(reference / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["step"] for r in writers.read_jsonl(str(reference / "samples.jsonl"))][-1] == 3
