"""`grpo_jax.preemption` in-process: the flag outside an abortable phase, the raise inside one
(the end-to-end signal tests, a run in a subprocess per phase: tests/test_reliability.py)."""

import signal
import sys

import pytest

from grpo_jax import preemption


def test_a_signal_outside_an_abortable_phase_only_sets_the_flag():
    before = signal.getsignal(signal.SIGTERM)
    ended = preemption.handled_runs_ended
    with preemption.Preemption() as sig:
        assert not sig.requested and sig.name == "signal"
        signal.raise_signal(signal.SIGTERM)
        assert sig.requested and sig.name == "SIGTERM"
        signal.raise_signal(signal.SIGINT)
        assert sig.name == "SIGTERM"  # the first signal names the stop
        ran = False
        with pytest.raises(preemption.Interrupted), sig.abortable():
            ran = True  # a signal before the phase stops it at its start
        assert not ran
    assert signal.getsignal(signal.SIGTERM) is before  # the old handlers are back
    assert preemption.handled_runs_ended == ended + 1


def test_a_signal_in_an_abortable_phase_raises_at_the_next_line_of_our_code():
    """A signal that lands outside the project's code (here: this test's frame) is raised by
    the trace function at the first line our code runs next, and the trace function set
    before the phase is put back."""
    trace = sys.gettrace()
    reached = False
    with preemption.Preemption() as sig:
        with pytest.raises(preemption.Interrupted), sig.abortable():
            signal.raise_signal(signal.SIGTERM)  # not our code: no raise here
            reached = True
            preemption.quiesce()  # our code: raises at its first line
            reached = False
        assert reached and sig.requested
    assert sys.gettrace() is trace
