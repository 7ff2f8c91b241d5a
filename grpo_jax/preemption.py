"""SIGTERM / SIGINT during a run: stop at the next safe point (docs/reliability.md, "Signals").

The run loop (`grpo_jax.train`) uses four names:

  with Preemption() as sig:            the handlers, for the whole job
      with sig.abortable(): ...        a phase that writes nothing (set-up, warm start,
                                       evaluation): a signal stops it, raising `Interrupted`
      if sig.agree(): ...              elsewhere a signal only sets ``sig.requested``; the
                                       loop asks when a step is done (checkpoint, exit)
  except Interrupted: quiesce()        wait for XLA's threads before unwinding

A job of several processes stops together: `agree` makes every process see a signal that any
one of them received, at the same step, and no phase is aborted (each process would abandon a
different collective: the others would wait in theirs for ever).

``sig.name`` is the signal's name for the one line the run ends with. `handled_runs_ended`
counts the runs whose handling has ended in this process (`experiments/run.py` reads it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import jax

from grpo_jax import distributed


class Interrupted(BaseException):
    """Raised by the signal handler inside an abortable phase (see `Preemption.abortable`)."""


_OWN_CODE = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
    for d in ("grpo_jax", "experiments", "configs")
)


def _own_frame(frame) -> bool:
    """True when ``frame`` runs this project's code (not JAX's, Orbax's or the stdlib's)."""
    return frame is not None and frame.f_code.co_filename.startswith(_OWN_CODE)


def quiesce() -> None:
    """Waits for every dispatched XLA computation to finish (their outputs are the live
    arrays), so no XLA thread still runs when an interrupted phase unwinds and the process
    exits (a teardown racing XLA's threads: the crash family of issue #35)."""
    for x in jax.live_arrays():
        with contextlib.suppress(Exception):  # deleted or donated meanwhile
            x.block_until_ready()


# runs whose signal handling (`Preemption`) has ended in this process: a signal after that
# reaches the caller's handler, which can tell it came after the run (experiments/run.py)
handled_runs_ended = 0


class Preemption:
    """SIGTERM / SIGINT -> stop at the next safe point, leaving a consistent checkpoint or none.

    Outside an `abortable` phase the handler only sets ``requested``: the loop finishes the step
    (generation, rewards, update), checkpoints it and exits. Inside one (the set-up, the warm
    start and the evaluations: phases that change nothing on disk and are redone exactly on a
    rerun) it raises `Interrupted`, but only in this project's own code: when the signal lands
    inside JAX, Orbax or the standard library (a tracing context, an asyncio loop, a ``finally``
    of theirs) a trace function (``sys.settrace``, on the main thread, until the raise) raises it
    at the next line our code executes, so the exception never unwinds a library's internals
    half-way. (A trace function set before, a debugger's or coverage's, is put back when the
    phase ends first; CPython unsets tracing when a trace function raises.)

    Off the main thread (e.g. a notebook worker) no handler is installed.

    Args:
      processes: the process indices that stop together (the training group; default: every
        process of the job). With more than one, phases are not aborted and `agree` is a
        barrier of theirs.
    """

    _SIGNALS = (signal.SIGTERM, signal.SIGINT)
    AGREE_TIMEOUT_S = 600  # seconds a process waits at `agree` for the others

    def __init__(self, processes=None):
        self.requested = False  # a signal arrived (here or, after `agree`, at another process)
        self.signum = None  # the first signal's number
        self._processes = tuple(range(jax.process_count()) if processes is None else processes)
        self.aborts = len(self._processes) <= 1  # whether `abortable` phases are aborted
        self._rounds = 0  # `agree` calls so far (every process makes the same ones)
        self._old = {}
        self._abortable = False
        self._tracing = None  # (previous trace function, frames given a local one)

    @property
    def name(self) -> str:
        """The first signal's name (``"SIGTERM"``), or ``"signal"`` before any."""
        return signal.Signals(self.signum).name if self.signum else "signal"

    def __enter__(self):
        for s in self._SIGNALS:
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread (e.g. a notebook worker): no handler
                break
        return self

    def _handle(self, signum, frame):
        self.requested = True
        self.signum = self.signum or signum
        if not self._abortable or self._tracing is not None or not self.aborts:
            return
        if _own_frame(frame):
            self._abortable = False
            raise Interrupted()
        self._raise_at_our_next_line(frame)

    def _raise_at_our_next_line(self, frame):
        def local(frame, event, arg):
            if event == "line" and self._abortable:
                self._stop_tracing()
                self._abortable = False
                raise Interrupted()
            return local

        def calls(frame, event, arg):
            return local if _own_frame(frame) else None

        marked = []
        f = frame
        while f is not None:  # the frames of ours that the library code will return to
            if _own_frame(f):
                f.f_trace, f.f_trace_lines = local, True
                marked.append(f)
            f = f.f_back
        self._tracing = (sys.gettrace(), marked)
        sys.settrace(calls)

    def _stop_tracing(self):
        if self._tracing is None:
            return
        previous, marked = self._tracing
        self._tracing = None
        for f in marked:
            f.f_trace = None
        sys.settrace(previous)

    @contextlib.contextmanager
    def abortable(self):
        """A phase a signal stops at once: raises `Interrupted` (at entry when a signal came
        before it). Only for phases that write nothing and are redone exactly on a rerun. In a
        job of several processes (not `aborts`) it does nothing: `agree` stops them together."""
        if self.requested and self.aborts:
            raise Interrupted()
        self._abortable = True
        try:
            yield
        finally:
            self._abortable = False
            self._stop_tracing()

    def agree(self) -> bool:
        """Whether the run stops now: this process's ``requested``, or, with several processes,
        whether any of them has received a signal (then ``requested`` and ``signum`` are set
        here too). Every process must call it at the same points (once per step); a barrier
        over the key-value store of `jax.distributed`.

        Raises:
          the store's error (a bare XlaRuntimeError) when a process does not arrive within
          `AGREE_TIMEOUT_S`.
        """
        if self.aborts:
            return self.requested
        self._rounds += 1
        kv, me = distributed.coordination_client(), jax.process_index()
        ns = f"grpo_jax/stop/{handled_runs_ended}/{self._rounds}"
        if self.requested:  # (a signal after this line is told at the next call)
            kv.key_value_set(f"{ns}/{me}", signal.Signals(self.signum).name)
        kv.wait_at_barrier(ns, self.AGREE_TIMEOUT_S * 1000, list(self._processes))
        names = [name for _, name in kv.key_value_dir_get(f"{ns}/")]
        if not names:  # every process answers the same, whatever arrived meanwhile
            return False
        self.requested, self.signum = True, self.signum or signal.Signals[names[0]].value
        return True

    def __exit__(self, *exc):
        global handled_runs_ended
        handled_runs_ended += 1  # before the old handlers return (experiments/run.py reads it)
        self._stop_tracing()
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}
