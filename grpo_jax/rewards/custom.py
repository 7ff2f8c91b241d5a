"""Your own reward function (``config.reward.fn = "module:function"``), run in the killable pool.

The function is a plain Python callable, batch-shaped like TRL's reward functions::

    def my_reward(completions: list[str], answers: list, **fields) -> list[float]:
        ...                       # or return (rewards, correct): two lists of the same length

``completions`` are the decoded completions (cut at EOS, no prompt), ``answers`` the gold
answers (``config.data.answer_column``: a string, a list of strings or any JSON value), and
``fields`` every other field of the rows (your table's own columns, ``problem``, ``level``, ...)
as lists aligned with ``completions``; accept ``**fields`` even if you read none. Without
``correct`` a completion counts as correct when its reward is > ``correct_above``.

It runs in `grpo_jax.rewards.verify.VerifierPool`'s worker processes, one completion per call,
each under ``timeout_s``: a call that hangs is killed (the worker restarts), one that raises or
returns something that is not a finite number is a crash; both score the low reward of the
scale (-1 for ``pm1``, 0 for ``01``), count as wrong and are counted (``num_timeouts``,
``num_crashes``); the first error of each kind is printed with its text and kept in the
workdir's ``reward_errors.jsonl`` (`grpo_jax.rewards.failures`). The module must be importable in the workers: on ``sys.path`` /
``PYTHONPATH`` (the workers inherit the trainer's ``sys.path``). It is imported once in the
trainer too, so a typo fails at start-up rather than as a crash per completion.

``format_reward`` is added when a completion matches ``format_pattern`` (a regex, searched).
"""

from __future__ import annotations

import functools
import math
import re
import threading
import time
from collections.abc import Sequence

import numpy as np

from grpo_jax.rewards.extract import extract_answer
from grpo_jax.rewards.failures import error_kind
from grpo_jax.rewards.verify import CRASH, OK, TIMEOUT, VerifierPool, resolve_checker

__all__ = ["UserRewardFn", "call_user_reward", "resolve_callable", "split_result"]

_ANSWER_KEYS = ("answer", "answers")


def resolve_callable(spec: str, what: str = "reward function"):
    """Import ``"module:function"``; ValueError (one line) naming the spec when it cannot."""
    try:
        fn = resolve_checker(spec)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(
            f"{what} {spec!r}: {type(e).__name__}: {e} (is its module on sys.path / PYTHONPATH?)"
        ) from None
    if not callable(fn):
        raise ValueError(f"{what} {spec!r} is not callable")
    return fn


@functools.lru_cache(maxsize=8)
def _resolved(spec: str):
    return resolve_checker(spec)


def split_result(result) -> tuple:
    """(rewards, correct or None) of what a reward function returned: a list of rewards, a
    ``(rewards, correct)`` pair or a ``{"rewards": ..., "correct": ...}`` dict."""
    if isinstance(result, dict):
        return result["rewards"], result.get("correct")
    if (
        isinstance(result, (tuple, list))
        and len(result) == 2
        and all(isinstance(r, (list, tuple, np.ndarray)) for r in result)
    ):  # (rewards, correct): a list of rewards holds numbers, never sequences
        return result[0], result[1]
    return result, None


def _normalise(result, n: int) -> tuple[list[float], list[bool] | None]:
    result, correct = split_result(result)
    rewards = [float(r) for r in result]
    if len(rewards) != n or (correct is not None and len(correct) != n):
        raise ValueError(f"reward function returned {len(rewards)} rewards for {n} completions")
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"reward function returned a non-finite reward: {rewards}")
    return rewards, None if correct is None else [bool(c) for c in correct]


def call_user_reward(completion: str, payload, *, fn: str):
    """Worker side: ``fn([completion], [answer], **{field: [value]})`` -> (reward, correct|None)."""
    answer, fields = payload
    result = _resolved(fn)([completion], [answer], **{k: [v] for k, v in fields.items()})
    rewards, correct = _normalise(result, 1)
    return rewards[0], None if correct is None else correct[0]


class UserRewardFn:
    """The `RewardFn` protocol around your function (see the module docstring).

    ``__call__(completions, golds, examples=None) -> (rewards [R] float32, correct [R] bool,
    stats)``; ``examples`` (the rows' example dicts) supply the ``**fields``.
    """

    takes_examples = True

    def __init__(
        self,
        fn: str,
        *,
        timeout_s: float = 5.0,
        num_workers: int = 2,
        scale: str = "pm1",
        correct_above: float = 0.0,
        format_reward: float = 0.0,
        format_pattern: str = "",
        extract: str = "",
        task: str = "math",
        start_method: str | None = None,
    ):
        resolve_callable(fn)  # fail at start-up, in the trainer, on a typo or an import error
        self.fn = fn
        self.failure = {"pm1": -1.0, "01": 0.0}[scale]
        self.correct_above = float(correct_above)
        self.format_reward = float(format_reward)
        self._format = re.compile(format_pattern) if format_pattern else None
        self._extract = resolve_callable(extract, "answer extractor") if extract else None
        self.task = task
        self._lock = threading.Lock()
        self._pool = VerifierPool(
            num_workers=num_workers,
            timeout_s=timeout_s,
            checker="grpo_jax.rewards.custom:call_user_reward",
            start_method=start_method,
            checker_kwargs={"fn": fn},
            raw=True,
        )

    def extract(self, completion: str):
        """The completion's final answer for maj@k (``reward.extract``, else the task's)."""
        if self._extract is not None:
            return self._extract(completion)

        return extract_answer(completion, self.task)[0]

    def __call__(self, completions: Sequence[str], golds: Sequence, examples=None):
        n = len(completions)
        if len(golds) != n or (examples is not None and len(examples) != n):
            raise ValueError(f"{n} completions but {len(golds)} golds")
        t0 = time.perf_counter()
        items = []
        for i, (c, g) in enumerate(zip(completions, golds)):
            ex = examples[i] if examples is not None else {}
            fields = {k: v for k, v in ex.items() if k not in _ANSWER_KEYS}
            items.append((c, (g, fields)))
        with self._lock:
            results = self._pool.run(items)
        rewards = np.full(n, self.failure, np.float32)
        correct = np.zeros(n, bool)
        stats = dict.fromkeys(
            ("num_timeouts", "num_crashes", "num_no_answer", "num_gold_errors", "num_fast_path"), 0
        )
        stats["num_checked"] = n
        errors = {}
        for i, (status, value) in enumerate(results):
            if status == OK:
                r, ok = value
                rewards[i] = r
                correct[i] = (r > self.correct_above) if ok is None else ok
                continue
            if status == TIMEOUT:
                stats["num_timeouts"] += 1
            elif status == CRASH:
                stats["num_crashes"] += 1
            kind, text = error_kind(status, value, self._pool.timeout_s)
            errors.setdefault(kind, text)
        fmt = np.asarray(
            [bool(self._format.search(c)) if self._format else False for c in completions], bool
        )
        if self.format_reward:
            rewards = rewards + np.float32(self.format_reward) * fmt.astype(np.float32)
        stats["num_format_ok"] = int(fmt.sum())
        stats["seconds"] = time.perf_counter() - t0
        stats["errors"] = errors
        return rewards, correct, stats

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> UserRewardFn:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
