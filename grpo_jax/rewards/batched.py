"""Reward functions called once per batch, several of them weighted (TRL's ``reward_funcs`` and
``reward_weights``): ``config.reward.fns`` + ``config.reward.weights``, or the Python API's
``reward_fns=[callable, ...]`` (`grpo_jax.api.train`).

A function is called once per scored batch with keyword arguments::

    def my_reward(completions, prompts, answers, prompt_ids, **columns) -> list[float | None]

``completions`` (list[str], cut at EOS, no prompt), ``prompts`` (each row's problem text, before
the template), ``answers`` (the gold answers), ``prompt_ids`` (int: rows with the same id are
one prompt's group) and every other column of the rows (``level``, your table's own columns),
each a list aligned with ``completions``. It returns one float per completion (or ``(rewards,
correct)``); ``None`` or a non-finite value marks that row's reward as failed.

The training reward is ``sum_k weights[k] * rewards_k (+ format_reward if the format matches)``.
A rollout for which any function failed (raised, hung past its limit, returned the wrong number
of values, or None / NaN / inf for its row) scores the low reward of the scale, counts as wrong
and is counted in ``num_crashes`` / ``num_timeouts`` (`grpo_jax.rewards.failures` reports it).
``correct``: every function that returns correctness agrees; without any, the weighted sum is
> ``correct_above``. Each function's mean over its scored rows is in the stats (``functions``).

Where a function runs: a ``"module:function"`` name, or a callable that pickles and lives outside
``__main__``, runs in the killable worker pool (`grpo_jax.rewards.verify.VerifierPool`, one pool
call per batch for all of them; a call past ``batch_timeout_s`` is killed). Any other callable
(a closure, a lambda, a function defined in a notebook) runs in the trainer's process, without a
time limit (an exception still counts as a failure).
"""

from __future__ import annotations

import functools
import math
import pickle
import re
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from grpo_jax.rewards.custom import resolve_callable, split_result
from grpo_jax.rewards.extract import extract_answer
from grpo_jax.rewards.failures import error_kind
from grpo_jax.rewards.verify import CRASH, OK, TIMEOUT, VerifierPool, resolve_checker

__all__ = ["BatchedRewards", "CALLABLE_PREFIX", "call_batched", "function_name", "runs_in_pool"]

CALLABLE_PREFIX = "callable:"  # config.reward.fns entry of a callable given to the Python API
_RESERVED = ("completions", "prompts", "answers", "prompt_ids", "answer")


def function_name(fn: str | Callable) -> str:
    """The metrics name of a reward function: ``"module:score"`` -> ``score``, a callable's
    ``__name__`` (its type's name for an instance), ``"callable:name"`` -> ``name``."""
    if isinstance(fn, str):
        return fn.rpartition(":")[2]
    return getattr(fn, "__name__", type(fn).__name__)


def runs_in_pool(fn: str | Callable) -> bool:
    """Whether ``fn`` can run in the worker pool: a name, or a callable that pickles by
    reference or value from a module other than ``__main__`` (workers cannot import that)."""
    if isinstance(fn, str):
        return True
    module = getattr(fn, "__module__", None) or type(fn).__module__
    if module == "__main__" or type(fn).__module__ == "__main__":
        return False
    try:
        pickle.dumps(fn)
    except Exception:  # closures, lambdas, local functions, unpicklable state
        return False
    return True


@functools.lru_cache(maxsize=16)
def _load(ref) -> Callable:
    return resolve_checker(ref) if isinstance(ref, str) else pickle.loads(ref)


def _values(result, n: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(rewards [n] float64, NaN = failed row; correct [n] bool or None) of a function's return
    value. Raises ValueError on a wrong count or a value that is not a number or None."""
    result, correct = split_result(result)
    rewards = np.asarray([math.nan if r is None else float(r) for r in result], np.float64)
    if len(rewards) != n or (correct is not None and len(correct) != n):
        raise ValueError(f"returned {len(rewards)} rewards for {n} completions")
    rewards[~np.isfinite(rewards)] = math.nan
    return rewards, None if correct is None else np.asarray([bool(c) for c in correct], bool)


def call_batched(batch: dict, ref) -> tuple:
    """Worker side: ``fn(**batch)`` of the function ``ref`` (a ``"module:function"`` name or a
    pickled callable), normalised to ``(rewards, correct | None)``."""
    return _values(_load(ref)(**batch), len(batch["completions"]))


class BatchedRewards:
    """The `grpo_jax.rewards.RewardFn` protocol around batched, weighted reward functions (see
    the module docstring).

    ``__call__(completions, golds, examples=None) -> (rewards [R] float32, correct [R] bool,
    stats)``; ``examples`` (the rows' example dicts) supply ``prompts``, ``prompt_ids`` and the
    columns. Stats: the counts of `grpo_jax.rewards.RewardFn` plus ``functions``: name ->
    ``(sum of its finite rewards, rows it scored)``.

    Args:
      fns: ``"module:function"`` names or callables.
      weights: one per function (default all 1).
      names: the metrics name of each function (default `function_name`; must be unique).
      timeout_s: per completion; ``batch_timeout_s`` (0: ``timeout_s`` x the batch's
        completions) limits one call in the pool.
      scale, correct_above, format_reward, format_pattern, extract, task, num_workers,
        start_method: as `grpo_jax.rewards.custom.UserRewardFn`.

    Raises: ValueError (one line) on a name that does not import, mismatched weights or names.
    """

    takes_examples = True

    def __init__(
        self,
        fns: Sequence[str | Callable],
        weights: Sequence[float] = (),
        *,
        names: Sequence[str] = (),
        timeout_s: float = 5.0,
        batch_timeout_s: float = 0.0,
        num_workers: int = 2,
        scale: str = "pm1",
        correct_above: float = 0.0,
        format_reward: float = 0.0,
        format_pattern: str = "",
        extract: str = "",
        task: str = "math",
        start_method: str | None = None,
    ):
        self.fns = tuple(fns)
        self.weights = np.asarray(tuple(weights) or (1.0,) * len(self.fns), np.float64)
        self.names = tuple(names) or tuple(function_name(f) for f in self.fns)
        if not self.fns or len(self.weights) != len(self.fns) or len(self.names) != len(self.fns):
            raise ValueError(
                f"{len(self.fns)} reward functions, {len(self.weights)} weights and "
                f"{len(self.names)} names: give one weight (and name) per function"
            )
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"reward function names must be unique, got {list(self.names)}")
        for f in self.fns:
            if isinstance(f, str):
                resolve_callable(f)  # a typo fails at start-up, in the trainer
        self._in_pool = [runs_in_pool(f) for f in self.fns]
        self._refs = [
            f if isinstance(f, str) or not pool else pickle.dumps(f)
            for f, pool in zip(self.fns, self._in_pool)
        ]
        self.timeout_s, self.batch_timeout_s = float(timeout_s), float(batch_timeout_s)
        self.failure = {"pm1": -1.0, "01": 0.0}[scale]
        self.correct_above = float(correct_above)
        self.format_reward = float(format_reward)
        self._format = re.compile(format_pattern) if format_pattern else None
        self._extract = resolve_callable(extract, "answer extractor") if extract else None
        self.task = task
        self._lock = threading.Lock()
        self._pool = None
        if any(self._in_pool):
            self._pool = VerifierPool(
                num_workers=num_workers,
                timeout_s=timeout_s,
                checker="grpo_jax.rewards.batched:call_batched",
                start_method=start_method,
                raw=True,
            )

    def extract(self, completion: str):
        """The completion's final answer for maj@k (``reward.extract``, else the task's)."""
        if self._extract is not None:
            return self._extract(completion)
        return extract_answer(completion, self.task)[0]

    def batch(self, completions: Sequence[str], golds: Sequence, examples=None) -> dict:
        """The keyword arguments of one call (see the module docstring)."""
        n = len(completions)
        examples = list(examples) if examples is not None else [{} for _ in range(n)]
        if len(golds) != n or len(examples) != n:
            raise ValueError(f"{n} completions but {len(golds)} golds, {len(examples)} rows")
        keys = dict.fromkeys(k for ex in examples for k in ex if k not in _RESERVED)
        out = {k: [ex.get(k) for ex in examples] for k in keys}
        out["completions"] = list(completions)
        out["prompts"] = [ex.get("problem") for ex in examples]
        out["answers"] = list(golds)
        out["prompt_ids"] = [ex.get("id") for ex in examples]
        return out

    def _results(self, batch: dict) -> list[tuple[str, object]]:
        """One ``(status, value)`` per function: the pool's for those that run there (one
        `VerifierPool.run`), the trainer's for the others."""
        n = len(batch["completions"])
        results: list = [None] * len(self.fns)
        for k, f in enumerate(self.fns):
            if not self._in_pool[k]:
                try:
                    results[k] = (OK, _values(f(**batch), n))
                except Exception as e:
                    results[k] = (CRASH, f"{type(e).__name__}: {e}")
        pooled = [k for k in range(len(self.fns)) if self._in_pool[k]]
        if pooled:
            items = [(batch, self._refs[k]) for k in pooled]
            for k, r in zip(pooled, self._pool.run(items, timeout_s=self.call_limit(n))):
                results[k] = r
        return results

    def call_limit(self, n: int) -> float:
        """Seconds one call in the pool may take for ``n`` completions."""
        return self.batch_timeout_s or self.timeout_s * max(n, 1)

    def __call__(self, completions: Sequence[str], golds: Sequence, examples=None):
        t0 = time.perf_counter()
        batch = self.batch(completions, golds, examples)
        n = len(completions)
        with self._lock:
            results = self._results(batch)
        total = np.zeros(n, np.float64)
        failed = np.zeros(n, bool)
        timed_out = np.zeros(n, bool)
        correct = np.ones(n, bool)
        judged = False
        errors, functions = {}, {}
        for name, w, (status, value) in zip(self.names, self.weights, results):
            if status == OK:
                r, ok = value
                if ok is not None:
                    correct &= ok
                    judged = True
                bad = np.isnan(r)
                if bad.any():
                    errors.setdefault(
                        "None/NaN",
                        f"{name} returned None or a non-finite value for {int(bad.sum())} of "
                        f"{n} completions",
                    )
            else:
                r, bad = np.full(n, math.nan), np.ones(n, bool)
                timed_out |= (status == TIMEOUT) & ~failed
                kind, text = error_kind(status, value, self.timeout_s)
                if status == TIMEOUT:
                    text = (
                        f"no result within {self.call_limit(n):g} s for {n} completions "
                        "(reward.batch_timeout_s; 0 = reward.timeout_s x completions); "
                        "worker killed"
                    )
                errors.setdefault(kind, f"{name}: {text}")
            failed |= bad
            total += w * np.where(bad, 0.0, r)
            functions[name] = (float(np.nansum(r)), int((~bad).sum()))
        if not judged:
            correct = total > self.correct_above
        correct &= ~failed
        rewards = np.where(failed, self.failure, total).astype(np.float32)
        fmt = np.asarray(
            [bool(self._format.search(c)) if self._format else False for c in completions], bool
        )
        if self.format_reward:
            rewards = rewards + np.float32(self.format_reward) * fmt.astype(np.float32)
        stats = dict.fromkeys(("num_no_answer", "num_gold_errors", "num_fast_path"), 0)
        stats.update(
            num_timeouts=int(timed_out.sum()),
            num_crashes=int((failed & ~timed_out).sum()),
            num_checked=n,
            num_format_ok=int(fmt.sum()),
            seconds=time.perf_counter() - t0,
            errors=errors,
            functions=functions,
        )
        return rewards, correct, stats

    def close(self) -> None:
        """Stops the worker processes (idempotent)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> BatchedRewards:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
