"""Answer verification with math-verify in killable worker processes.

`math_verify_check` compares one extracted answer with a gold answer. It runs inside the worker
processes of `VerifierPool`, which enforces a per-item wall-clock timeout by *killing* a worker
that overruns and starting a fresh one, so a pathological expression (sympy can hang on some
inputs) costs one item, never the batch or the training run.

Why not math-verify's own timeout: it uses ``signal.alarm``, which only works in the main thread
of the main interpreter; the trainer calls rewards from any thread. We pass
``parsing_timeout=None`` / ``timeout_seconds=None`` and time items at the pool level instead.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot kill one hung worker (a timed-out
future keeps its process busy forever, and terminating it breaks the whole executor). The pool
here is a few lines of ``multiprocessing`` with one pipe per worker. Workers are started with
the ``forkserver`` method (``spawn`` where unavailable), never ``fork``: forking a process that
runs JAX's thread pools is unsafe.

Scripts that build a pool (a `RewardFn` for math/gsm8k) must guard their entry point with
``if __name__ == "__main__":`` - the standard multiprocessing rule: forkserver/spawn children
import the main module.

Checkers are named ``"module:function"`` and resolved inside the worker, so tests can inject a
checker that sleeps or crashes. A checker is called as ``fn(pred: str, gold: str | tuple[str,
...], **checker_kwargs) -> bool`` (``checker_kwargs`` of `VerifierPool`, empty by default) and may
raise `GoldParseError` to flag a gold answer that does not parse.

Precision: math-verify compares two exact expressions numerically with
``(gold - pred).evalf(n=numeric_precision, chop=True) == 0``; ``chop`` zeroes a difference below
about ``10**-numeric_precision``. At math-verify's default (15 digits) ``1/2^99`` and ``1/2^98``
(difference ~1.6e-30) are scored equal. `math_verify_check` defaults to
`DEFAULT_NUMERIC_PRECISION` = 100 digits (distinguishes values down to ~1e-100, e.g. ``2^{-330}``
from ``2^{-331}``). ``float_rounding`` (decimal places, math-verify's default 6) is a separate
rule: when either side is a decimal literal both are rounded to that many places, so ``1/3`` and
``0.333333`` stay equal (and so would ``1/2^99`` and ``0.0``: a decimal answer is only as precise
as ``float_rounding``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import multiprocessing as mp
import os
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Sequence
from multiprocessing import connection as mp_connection
from typing import Any

from grpo_jax.rewards.extract import split_top_level

__all__ = [
    "DEFAULT_CHECKER",
    "DEFAULT_FLOAT_ROUNDING",
    "DEFAULT_NUMERIC_PRECISION",
    "GoldParseError",
    "VerifierPool",
    "math_verify_check",
    "parse_answer",
    "resolve_checker",
]

DEFAULT_CHECKER = "grpo_jax.rewards.verify:math_verify_check"
# Significant digits of math-verify's numeric comparison (its own default, 15, equates values
# that differ by less than ~1e-15, e.g. 1/2^99 and 1/2^98) and decimal places for decimal
# literals (math-verify's default).
DEFAULT_NUMERIC_PRECISION = 100
DEFAULT_FLOAT_ROUNDING = 6

# Item outcome statuses returned by VerifierPool.run.
OK, TIMEOUT, CRASH, GOLD_ERROR = "ok", "timeout", "crash", "gold_error"


class GoldParseError(ValueError):
    """A gold answer that math-verify cannot parse: a data error, never a reward."""


@functools.lru_cache(maxsize=4096)
def parse_answer(answer: str) -> tuple:
    """Parse one extracted answer string with math-verify (no internal timeout).

    The string is wrapped as ``\\boxed{answer}`` so that math-verify's LaTeX extractor takes it
    whole (``\\frac{1}{2}``, ``(0,1)``, ``1,000``, matrices) instead of searching it for a
    number. Returns math-verify's list (sympy objects then the matched string) as a tuple;
    empty when nothing parses. Cached per process (the G rollouts of a prompt share a gold).
    """
    import math_verify  # imported lazily: ~0.7 s (sympy), only in workers

    return tuple(math_verify.parse("\\boxed{" + answer + "}", parsing_timeout=None))


def _verify(
    gold_parsed: tuple,
    pred_parsed: tuple,
    numeric_precision: int = DEFAULT_NUMERIC_PRECISION,
    float_rounding: int = DEFAULT_FLOAT_ROUNDING,
) -> bool:
    import math_verify

    return bool(
        math_verify.verify(
            list(gold_parsed),
            list(pred_parsed),
            float_rounding=float_rounding,
            numeric_precision=numeric_precision,
            timeout_seconds=None,
        )
    )


def _gold(g: str) -> tuple:
    parsed = parse_answer(g)
    if not parsed:
        raise GoldParseError(f"gold answer does not parse: {g!r}")
    return parsed


def math_verify_check(
    pred: str,
    gold: str | Sequence[str],
    *,
    numeric_precision: int = DEFAULT_NUMERIC_PRECISION,
    float_rounding: int = DEFAULT_FLOAT_ROUNDING,
) -> bool:
    """Is the extracted answer `pred` equivalent to `gold` (math-verify, strict mode)?

    Args:
      pred: extracted answer string of a completion (e.g. ``"0.5"``).
      gold: gold answer string, or a list of strings = a multi-part answer (OlympiadBench's
        ``is_multiple_answer``): correct when `pred` matches the comma-joined golds as a whole
        (tuple/set, order-insensitive for sets) or `pred` splits at top-level commas into exactly
        as many parts, each matching a different gold part.
      numeric_precision: significant digits of math-verify's numeric comparison of exact
        expressions (``verify(numeric_precision=)``; a difference below about
        ``10**-numeric_precision`` counts as 0). Default 100: ``1/2^99`` != ``1/2^98``
        (math-verify's own default, 15, equates them).
      float_rounding: decimal places both sides are rounded to when one is a decimal literal
        (``verify(float_rounding=)``, default 6: ``1/3`` == ``0.333333``).

    Returns:
      bool.

    Raises:
      GoldParseError: a gold (part) does not parse.
    """
    prec = {"numeric_precision": int(numeric_precision), "float_rounding": int(float_rounding)}
    if isinstance(gold, str):
        gold_parsed = _gold(gold)
        pred_parsed = parse_answer(pred)
        return bool(pred_parsed) and _verify(gold_parsed, pred_parsed, **prec)
    golds = [str(g) for g in gold]
    if len(golds) == 1:
        return math_verify_check(pred, golds[0], **prec)
    parsed_parts = [_gold(g) for g in golds]
    whole = parse_answer(", ".join(golds))
    pred_parsed = parse_answer(pred)
    if whole and pred_parsed and _verify(whole, pred_parsed, **prec):
        return True
    pred_parts = split_top_level(pred)
    if len(pred_parts) != len(golds):
        return False
    unused = list(range(len(golds)))
    for part in pred_parts:
        pp = parse_answer(part)
        hit = next((k for k in unused if pp and _verify(parsed_parts[k], pp, **prec)), None)
        if hit is None:
            return False
        unused.remove(hit)
    return True


def resolve_checker(spec: str):
    """Import ``"package.module:function"`` and return the function."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"checker must be 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module), name)


# ------------------------------------------------------------------------------------------------
# Worker process.
# ------------------------------------------------------------------------------------------------
def _worker_main(
    conn, checker: str, sys_path: list[str], checker_kwargs: dict | None = None, raw: bool = False
) -> None:  # pragma: no cover (subprocess)
    """Worker loop: receive ``(idx, pred, gold)``, send ``(idx, status, value)`` (``value`` is
    ``bool(result)``, or the checker's result as it is with ``raw``)."""
    checker_kwargs = dict(checker_kwargs or {})
    sys.path[:] = list(sys_path)
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        fn = resolve_checker(checker)
        if checker == DEFAULT_CHECKER:
            import math_verify  # noqa: F401 -- preload in the worker
    except BaseException as e:
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, pred, gold = msg
        try:
            value = fn(pred, gold, **checker_kwargs)
            conn.send((idx, OK, value if raw else bool(value)))
        except GoldParseError as e:
            conn.send((idx, GOLD_ERROR, str(e)))
        except Exception as e:
            conn.send((idx, CRASH, f"{type(e).__name__}: {e}"))


class _Worker:
    __slots__ = ("proc", "conn", "ready", "item", "deadline", "started")

    def __init__(self, ctx, checker: str, checker_kwargs: dict | None = None, raw: bool = False):
        parent, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_worker_main,
            args=(child, checker, list(sys.path), dict(checker_kwargs or {}), raw),
            daemon=True,
            name="grpo_jax-verifier",
        )
        self.proc.start()
        child.close()
        self.conn = parent
        self.ready = False
        self.item: int | None = None
        self.deadline = 0.0
        self.started = time.monotonic()

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.join(timeout=5)
        except (OSError, ValueError):
            pass
        with contextlib.suppress(OSError):
            self.conn.close()


class VerifierPool:
    """A pool of verifier processes with a per-item timeout and hung/crashed-worker replacement.

    Args:
      num_workers: number of worker processes (>= 1).
      timeout_s: wall-clock seconds one item may take in a worker, from dispatch to answer.
      checker: ``"module:function"`` of the checker (default `math_verify_check`).
      start_method: ``"forkserver"`` (default where available) or ``"spawn"``; ``"fork"`` is
        refused (unsafe in a process running JAX).
      startup_timeout_s: seconds a new worker may take to import the checker.
      checker_kwargs: keyword arguments passed to every checker call (picklable values), e.g.
        ``{"numeric_precision": 100}`` for `math_verify_check`; default none.
      raw: return the checker's (picklable) result as it is instead of ``bool(result)`` (your
        own reward functions: `grpo_jax.rewards.custom`).

    `run` is thread-safe (calls are serialised) and may be called from any thread. Workers start
    on the first `run` and persist until `close` (also on garbage collection / interpreter exit:
    they are daemons).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        checker: str = DEFAULT_CHECKER,
        start_method: str | None = None,
        startup_timeout_s: float = 120.0,
        checker_kwargs: dict | None = None,
        raw: bool = False,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if start_method is None:
            start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        if start_method == "fork":
            raise ValueError("start_method='fork' is unsafe with JAX threads; use forkserver/spawn")
        self._ctx = mp.get_context(start_method)
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        self.checker = checker
        self.startup_timeout_s = float(startup_timeout_s)
        self.checker_kwargs = dict(checker_kwargs or {})
        self.raw = bool(raw)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.num_restarts = 0

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self.checker, self.checker_kwargs, self.raw)

    def _replace(self, k: int, count: bool = True) -> None:
        self._workers[k].kill()
        self._workers[k] = self._spawn()
        self.num_restarts += int(count)

    def run(
        self, items: Sequence[tuple[str, Any]], timeout_s: float | None = None
    ) -> list[tuple[str, Any]]:
        """Check ``(pred, gold)`` pairs, each within ``timeout_s`` seconds (default: the pool's).

        Returns:
          One ``(status, value)`` per item, in order: ``("ok", bool)``, ``("timeout", None)``,
          ``("crash", message)`` (checker raised or the worker died) or ``("gold_error",
          message)``.

        Raises:
          RuntimeError: the pool is closed, or workers cannot start (bad checker, import error).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifierPool is closed")
            return self._run(list(items), self.timeout_s if timeout_s is None else timeout_s)

    def _run(self, items: list[tuple[str, Any]], timeout_s: float) -> list[tuple[str, Any]]:
        results: list[tuple[str, Any] | None] = [None] * len(items)
        if not items:
            return []
        while len(self._workers) < self.num_workers:
            self._workers.append(self._spawn())
        # Gold affinity: items with the same gold go to the same worker's queue so its parse
        # cache hits (the rollouts of a prompt share a gold); idle workers steal when theirs
        # is empty.
        queues = [deque() for _ in self._workers]
        for idx, (_, gold) in enumerate(items):
            queues[zlib.crc32(repr(gold).encode()) % len(queues)].append(idx)
        remaining = len(items)
        while remaining:
            self._dispatch(queues, items, timeout_s)
            ready_handles = self._wait()
            for k, w in enumerate(self._workers):
                if w.conn in ready_handles or w.proc.sentinel in ready_handles:
                    remaining -= self._collect(k, w, results)
            remaining -= self._expire(results)
        return results  # type: ignore[return-value]

    def _dispatch(
        self, queues: list[deque], items: list[tuple[str, Any]], timeout_s: float
    ) -> None:
        """Sends the next item of its queue (or of the longest one) to each idle ready worker."""
        for k, w in enumerate(self._workers):
            if not (w.ready and w.item is None):
                continue
            queue = queues[k] if queues[k] else max(queues, key=len)
            if not queue:
                continue
            idx = queue.popleft()
            try:
                w.conn.send((idx, items[idx][0], items[idx][1]))
            except (OSError, ValueError):  # broken pipe: died while idle
                queue.appendleft(idx)
                w.proc.kill()  # `_collect` replaces it
                continue
            w.item = idx
            w.deadline = time.monotonic() + timeout_s

    def _wait(self) -> set:
        """Blocks until a worker answers or exits, or the nearest deadline passes."""
        now = time.monotonic()
        deadlines = [
            w.deadline if w.item is not None else w.started + self.startup_timeout_s
            for w in self._workers
            if w.item is not None or not w.ready
        ]
        wait_s = max(0.0, min(deadlines) - now) if deadlines else None
        handles = [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
        return set(mp_connection.wait(handles, timeout=wait_s))

    def _collect(self, k: int, w: _Worker, results: list) -> int:
        """Reads worker ``k``'s message, or notices that it died (its item a crash, the worker
        replaced). Returns the number of items it finished (0 or 1)."""
        msg = None
        try:  # drain a message first: a worker may answer and then exit
            if w.conn.poll():
                msg = w.conn.recv()
        except (EOFError, OSError):
            msg = None
        if msg is not None:
            if msg[0] == "ready":
                w.ready = True
                return 0
            if msg[0] == "init_error":
                self._close_workers()
                raise RuntimeError(
                    f"verifier workers cannot start (checker {self.checker!r}): {msg[1]}"
                )
            idx, status, value = msg
            if idx != w.item:
                return 0
            results[idx] = (status, value)
            w.item = None
            return 1
        if w.proc.is_alive():
            return 0
        if not w.ready and w.item is None:
            self._close_workers()
            raise RuntimeError(
                f"verifier worker died during start-up (exit code "
                f"{w.proc.exitcode}, checker {self.checker!r})"
            )
        done = 0
        if w.item is not None:
            results[w.item] = (CRASH, f"worker died (exit code {w.proc.exitcode})")
            done = 1
        self._replace(k)
        return done

    def _expire(self, results: list) -> int:
        """Times out items past their deadline (worker replaced); returns how many."""
        now, done = time.monotonic(), 0
        for k, w in enumerate(self._workers):
            if w.item is not None and now >= w.deadline:
                results[w.item] = (TIMEOUT, None)
                done += 1
                self._replace(k)
            elif not w.ready and w.item is None and now >= w.started + self.startup_timeout_s:
                self._close_workers()
                raise RuntimeError(
                    f"verifier worker did not start within {self.startup_timeout_s:.0f} s"
                )
        return done

    def _close_workers(self) -> None:
        for w in self._workers:
            try:
                if w.proc.is_alive() and w.item is None and w.ready:
                    w.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for w in self._workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=5)
            with contextlib.suppress(OSError):
                w.conn.close()
        self._workers = []

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        with self._lock:
            self._closed = True
            self._close_workers()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not self._closed:
                self._close_workers()
        except Exception:
            pass
