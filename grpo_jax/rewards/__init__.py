"""Verifiable rewards: answer extraction + math-verify in a killable worker pool.

Usage::

    with RewardFn(RewardConfig(task="math")) as reward_fn:
        rewards, correct, stats = reward_fn(completions, golds)

Reward of one completion (``scale="pm1"``, the paper's ±1 from a math verifier, spec/gdro.md §5;
``"01"`` gives 1/0)::

    reward = (hi if correct else lo) + format_reward * format_ok

``correct`` needs an extracted answer that verifies against the gold; no answer, a timeout, a
crashed check or an unparseable gold all score as wrong (and are counted in ``stats``).

Tasks:
  * ``"math"``: answer = last ``\\boxed{}`` (else ``Answer:`` line, else ``####``), checked with
    math-verify in worker processes; ``format_ok`` = the answer came from ``\\boxed{}``.
    An answer and a gold that are both plain integers are compared in-process (exact integer
    equality, the same decision math-verify makes) - most of DAPO/GSM8K/AIME never reach the pool.
  * ``"gsm8k"``: answer = last ``####`` (else boxed / ``Answer:`` / last number), reduced to a
    number; math-verify in workers; ``format_ok`` = ``####`` or ``\\boxed``.
  * ``"arithmetic"``: exact integer match of the stripped completion (text up to EOS) in-process
    (`grpo_jax.rewards.extract.integer_answer_is_correct`); ``format_ok`` = the completion is an integer
    literal. No worker pool is started.

Golds are answer strings (``example["answer"]``) or, for multi-part answers (OlympiadBench
``is_multiple_answer``), lists of strings (``example["answers"]``): all parts must be given.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Sequence

import numpy as np

from grpo_jax.rewards.batched import BatchedRewards
from grpo_jax.rewards.custom import UserRewardFn
from grpo_jax.rewards.extract import PRIMARY_FORMATS, extract_answer, integer_answer_is_correct
from grpo_jax.rewards.failures import error_kind
from grpo_jax.rewards.verify import (
    CRASH,
    DEFAULT_CHECKER,
    DEFAULT_FLOAT_ROUNDING,
    DEFAULT_NUMERIC_PRECISION,
    GOLD_ERROR,
    OK,
    TIMEOUT,
    GoldParseError,
    VerifierPool,
)

__all__ = [
    "BatchedRewards",
    "RewardConfig",
    "RewardFn",
    "GoldParseError",
    "UserRewardFn",
    "compute_rewards",
    "metrics_fields",
]

_TASKS = ("math", "gsm8k", "arithmetic")
_SCALES = {"pm1": (1.0, -1.0), "01": (1.0, 0.0)}
_INT_RE = re.compile(r"-?\d{1,30}")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward configuration.

    Attributes:
      task: ``"math"`` | ``"gsm8k"`` | ``"arithmetic"`` (see module docstring).
      scale: ``"pm1"`` (+1 correct / -1 wrong, the paper) or ``"01"``.
      format_reward: added to the reward when the completion uses the task's answer format
        (0 = off).
      timeout_s: wall-clock limit per verified item (seconds); an overrun kills the worker.
      num_workers: verifier processes (math / gsm8k only).
      on_gold_error: ``"count"`` (score wrong, count in ``stats["num_gold_errors"]``) or
        ``"raise"`` (GoldParseError) when a gold answer does not parse.
      checker: ``"module:function"`` run in the workers (tests inject slow/crashing ones).
      start_method: worker start method, ``"forkserver"`` (default) or ``"spawn"``.
      integer_fast_path: compare integer answers with integer golds in-process (default
        checker only; same decision as math-verify, see tests).
      numeric_precision: significant digits of math-verify's numeric comparison (default
        checker only; see `grpo_jax.rewards.verify`). The default, 100, scores ``1/2^99`` vs
        ``1/2^98`` wrong; math-verify's own default, 15, would score them equal.
      float_rounding: decimal places when one side is a decimal literal (default checker only;
        math-verify's default 6: ``0.333333`` == ``1/3``).
      format_pattern: a regex; when set, ``format_ok`` = the completion matches it (searched)
        instead of the task's answer marker.
    """

    task: str = "math"
    scale: str = "pm1"
    format_reward: float = 0.0
    timeout_s: float = 5.0
    num_workers: int = 2
    on_gold_error: str = "count"
    checker: str = DEFAULT_CHECKER
    start_method: str | None = None
    integer_fast_path: bool = True
    numeric_precision: int = DEFAULT_NUMERIC_PRECISION
    float_rounding: int = DEFAULT_FLOAT_ROUNDING
    format_pattern: str = ""

    def __post_init__(self):
        if self.task not in _TASKS:
            raise ValueError(f"RewardConfig.task must be one of {_TASKS}, got {self.task!r}")
        if self.scale not in _SCALES:
            raise ValueError(
                f"RewardConfig.scale must be one of {tuple(_SCALES)}, got {self.scale!r}"
            )
        if self.on_gold_error not in ("count", "raise"):
            raise ValueError(
                f"RewardConfig.on_gold_error must be 'count' or 'raise', got {self.on_gold_error!r}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"RewardConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.num_workers < 1:
            raise ValueError(f"RewardConfig.num_workers must be >= 1, got {self.num_workers}")
        if not self.numeric_precision >= 1:
            raise ValueError(
                f"RewardConfig.numeric_precision must be >= 1, got {self.numeric_precision}"
            )
        if not self.float_rounding >= 0:
            raise ValueError(f"RewardConfig.float_rounding must be >= 0, got {self.float_rounding}")


def _gold_key(gold) -> str | tuple[str, ...]:
    if isinstance(gold, str):
        return gold
    if isinstance(gold, (int, np.integer)):
        return str(int(gold))
    return tuple(str(g) for g in gold)


class RewardFn:
    """Scores completions against gold answers. Owns a verifier pool; thread-safe.

    Use as a context manager or call `close()` to stop the worker processes.
    """

    def __init__(self, config: RewardConfig = RewardConfig()):
        self.config = config
        self._hi, self._lo = _SCALES[config.scale]
        self._pool: VerifierPool | None = None
        self._lock = threading.Lock()
        if config.task != "arithmetic":
            self._pool = VerifierPool(
                num_workers=config.num_workers,
                timeout_s=config.timeout_s,
                checker=config.checker,
                start_method=config.start_method,
                checker_kwargs=(
                    {
                        "numeric_precision": config.numeric_precision,
                        "float_rounding": config.float_rounding,
                    }
                    if config.checker == DEFAULT_CHECKER
                    else None
                ),
            )

    def extract(self, completion: str) -> str | None:
        """The completion's final answer as the task extracts it (None: none), for maj@k."""
        if self.config.task == "arithmetic":
            text = completion.strip()
            return text if _INT_RE.fullmatch(text) else (text or None)
        return extract_answer(completion, self.config.task)[0]

    def __call__(
        self, completions: Sequence[str], golds: Sequence, examples=None
    ) -> tuple[np.ndarray, np.ndarray, dict]:
        """Score a batch.

        Args:
          completions: ``R`` decoded completion texts (cut at EOS, no prompt).
          golds: ``R`` gold answers (str, or list[str] for a multi-part answer; ints are
            accepted for the arithmetic task).
          examples: the rows' example dicts (unused here; `UserRewardFn` reads them).

        Returns:
          ``(rewards, correct, stats)``: float32 [R], bool [R] and a dict with int counts
          ``num_timeouts``, ``num_crashes``, ``num_no_answer``, ``num_format_ok``,
          ``num_gold_errors``, ``num_checked`` (distinct (answer, gold) pairs checked),
          ``num_fast_path`` (of those, integer-vs-integer pairs compared in-process without
          the pool), ``seconds`` (wall time, float) and ``errors`` (failure kind -> the text of
          its first occurrence in the batch, `grpo_jax.rewards.failures.error_kind`).

        Raises:
          ValueError: length mismatch; GoldParseError with ``on_gold_error="raise"``.
        """
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} golds")
        t0 = time.perf_counter()
        with self._lock:
            if self.config.task == "arithmetic":
                correct, fmt, stats = self._arithmetic(completions, golds)
            else:
                correct, fmt, stats = self._verified(completions, golds)
        del examples
        if self.config.format_pattern:
            pattern = re.compile(self.config.format_pattern)
            fmt = np.asarray([bool(pattern.search(c)) for c in completions], bool)
        rewards = np.where(correct, self._hi, self._lo).astype(np.float32)
        if self.config.format_reward:
            rewards = rewards + np.float32(self.config.format_reward) * fmt.astype(np.float32)
        stats["num_format_ok"] = int(fmt.sum())
        stats["seconds"] = time.perf_counter() - t0
        return rewards, correct, stats

    def _arithmetic(self, completions, golds):
        n = len(completions)
        correct = np.zeros(n, dtype=bool)
        fmt = np.zeros(n, dtype=bool)
        no_answer = 0
        for i, (c, g) in enumerate(zip(completions, golds)):
            text = c.strip()
            fmt[i] = bool(_INT_RE.fullmatch(text))
            no_answer += not text
            correct[i] = integer_answer_is_correct(text, g)
        stats = {
            "num_timeouts": 0,
            "num_crashes": 0,
            "num_no_answer": no_answer,
            "num_gold_errors": 0,
            "num_checked": 0,
            "num_fast_path": 0,
            "errors": {},
        }
        return correct, fmt, stats

    def _verified(self, completions, golds):
        task = self.config.task
        n = len(completions)
        correct = np.zeros(n, dtype=bool)
        fmt = np.zeros(n, dtype=bool)
        primary = PRIMARY_FORMATS[task]
        keys: dict[tuple, list[int]] = {}
        no_answer = 0
        for i, (c, g) in enumerate(zip(completions, golds)):
            ans, method = extract_answer(c, task)
            fmt[i] = method in primary
            if ans is None:
                no_answer += 1
                continue
            keys.setdefault((ans, _gold_key(g)), []).append(i)
        # Fast path (default checker only): integer answer vs integer gold is exact integer
        # equality, which is also what math-verify decides; DAPO and GSM8K golds are integers.
        fast = 0
        if self.config.integer_fast_path and self.config.checker == DEFAULT_CHECKER:
            for key in list(keys):
                ans, gold = key
                if isinstance(gold, str) and _INT_RE.fullmatch(ans) and _INT_RE.fullmatch(gold):
                    correct[keys.pop(key)] = int(ans) == int(gold)
                    fast += 1
        unique = list(keys)
        results = self._pool.run(unique) if unique else []
        stats = {
            "num_timeouts": 0,
            "num_crashes": 0,
            "num_no_answer": no_answer,
            "num_gold_errors": 0,
            "num_checked": len(unique) + fast,
            "num_fast_path": fast,
            "errors": {},
        }
        for key, (status, value) in zip(unique, results):
            rows = keys[key]
            if status == OK:
                correct[rows] = bool(value)
            elif status in (TIMEOUT, CRASH):
                stats["num_timeouts" if status == TIMEOUT else "num_crashes"] += len(rows)
                kind, text = error_kind(status, value, self.config.timeout_s)
                stats["errors"].setdefault(kind, text)
            elif status == GOLD_ERROR:
                if self.config.on_gold_error == "raise":
                    raise GoldParseError(value)
                stats["num_gold_errors"] += len(rows)
        return correct, fmt, stats

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardFn:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def compute_rewards(
    completions: Sequence[str], golds: Sequence, config: RewardConfig = RewardConfig()
):
    """One-shot convenience wrapper: `RewardFn(config)(completions, golds)`, pool closed after."""
    with RewardFn(config) as fn:
        return fn(completions, golds)


def metrics_fields(stats: Sequence[dict]) -> dict:
    """A step's ``reward/*`` metrics from the stats of its sampling rounds (each a reward
    function's stats without ``errors``): the counts summed (ints), ``reward/model_score_mean``
    (a reward model's raw score, `grpo_jax.rewards.model.ModelReward`) and ``reward/<name>_mean``
    for each batched reward function (`BatchedRewards`: its mean over the rows it scored, NaN
    when it scored none)."""
    total = {k: sum(s[k] for s in stats) for k in stats[0] if k != "functions"}
    score_sum = total.pop("model_score_sum", None)
    out = {f"reward/{k}": int(v) for k, v in total.items()}
    if score_sum is not None:
        out["reward/model_score_mean"] = score_sum / max(total["num_model_scored"], 1)
    for name in stats[0].get("functions", {}):
        s, c = (sum(x["functions"][name][i] for x in stats) for i in (0, 1))
        out[f"reward/{name}_mean"] = s / c if c else float("nan")
    return out
