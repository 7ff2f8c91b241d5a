"""A run's reward failures made visible: the first error of each kind, a stop, a final warning.

A reward that raises, hangs past ``reward.timeout_s``, returns something that is not a finite
number or the wrong number of rewards scores the low reward and counts as wrong (the run goes
on; ``reward/num_crashes`` and ``reward/num_timeouts`` in ``metrics.jsonl``). `RewardFailures`
watches those counts on the host, once per RL step, and:

* prints the first error of each kind (the exception's type, ``timeout``, ``worker died``) once,
  with its text, and appends it to ``<workdir>/reward_errors.jsonl`` (process 0; on resume the
  lines after the restored step are dropped, so the file equals the uninterrupted run's);
* raises `RewardFailureError` naming the function after ``reward.max_failed_steps``
  consecutive steps in which every rollout's reward failed (0 = never);
* says in the run's last lines when more than ``reward.warn_failure_rate`` of the run's
  rollouts had a failed reward (`RewardFailures.final_warning`).

Its counters travel in the checkpoint's meta (`RewardFailures.state`), so a resumed run
counts as the uninterrupted one does.
"""

from __future__ import annotations

import json
import os

__all__ = ["ERRORS_FILE", "RewardFailureError", "RewardFailures", "error_kind"]

ERRORS_FILE = "reward_errors.jsonl"


class RewardFailureError(RuntimeError):
    """Every rollout's reward failed in ``reward.max_failed_steps`` consecutive steps."""


def error_kind(status: str, value, timeout_s: float) -> tuple[str, str]:
    """(kind, text) of a failed verifier item (`grpo_jax.rewards.verify.VerifierPool.run`'s
    ``("crash", "Type: message")`` or ``("timeout", None)``): the kind is the exception's type
    name, ``"timeout"`` or ``"worker died"``."""
    if status == "timeout":
        return "timeout", f"no result within reward.timeout_s={timeout_s:g} s (worker killed)"
    text = str(value)
    if text.startswith("worker died"):
        return "worker died", text
    kind = text.partition(":")[0].strip()
    return (kind if kind.isidentifier() else "error"), text


class RewardFailures:
    """Host-side watch of a run's reward failures (see the module docstring).

    Args:
      fn: what scores the rollouts, for messages (``reward.fn``, or the built-in verifier's task).
      max_failed_steps: consecutive all-failed steps that stop the run (0 = never).
      warn_rate: the run's failed share above which `final_warning` says so.
      path: ``reward_errors.jsonl`` (None: nothing written, e.g. processes other than 0).
      state: a checkpoint's `state` (None: a new run).
      step: the restored step (lines of ``path`` after it are dropped).
    """

    def __init__(
        self,
        fn: str,
        *,
        max_failed_steps: int,
        warn_rate: float,
        path: str | None = None,
        state: dict | None = None,
        step: int = 0,
    ):
        self.fn = fn
        self.max_failed_steps = int(max_failed_steps)
        self.warn_rate = float(warn_rate)
        self.path = path
        s = dict(state or {})
        self.failed = int(s.get("failed", 0))
        self.scored = int(s.get("scored", 0))
        self.consecutive = int(s.get("consecutive", 0))
        self.seen = set(s.get("kinds", ()))
        if path is not None and os.path.exists(path):
            _keep_through(path, step)

    def state(self) -> dict:
        """The counters, for the checkpoint's meta (JSON-able)."""
        return {
            "failed": self.failed,
            "scored": self.scored,
            "consecutive": self.consecutive,
            "kinds": sorted(self.seen),
        }

    def observe(self, step: int, failed: int, scored: int, errors: dict) -> list[str]:
        """Counts one step: ``failed`` of its ``scored`` rollouts had a failed reward; ``errors``
        maps kind -> the first text of that kind in the step. Returns the lines to print (the
        kinds not seen before), after appending them to the file.

        Raises: RewardFailureError after ``max_failed_steps`` consecutive all-failed steps.
        """
        self.failed += int(failed)
        self.scored += int(scored)
        self.consecutive = self.consecutive + 1 if scored and failed >= scored else 0
        lines, rows = [], []
        for kind in sorted(errors):
            if kind in self.seen:
                continue
            self.seen.add(kind)
            text = " ".join(str(errors[kind]).split())
            rows.append({"step": int(step), "fn": self.fn, "kind": kind, "message": text})
            lines.append(
                f"WARNING: step {step}: the reward function {self.fn} failed ({kind}): {text}; "
                "such rollouts score the low reward and count as wrong (shown once per kind, "
                f"kept in {self.path or ERRORS_FILE})"
            )
        if rows and self.path is not None:
            with open(self.path, "a") as f:
                f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)
                f.flush()
                os.fsync(f.fileno())
        if self.max_failed_steps and self.consecutive >= self.max_failed_steps:
            last = "; ".join(" ".join(str(v).split()) for _, v in sorted(errors.items()))
            raise RewardFailureError(
                f"step {step}: the reward function {self.fn} failed on every rollout for "
                f"{self.consecutive} consecutive steps (config.reward.max_failed_steps="
                f"{self.max_failed_steps}); last error: {last or 'none recorded'}. Fix the "
                "function (run it on a few completions by hand) and rerun"
            )
        return lines

    def final_warning(self) -> str | None:
        """The run's closing line when its failed share is above ``warn_rate`` (else None)."""
        if not self.scored or self.failed / self.scored <= self.warn_rate:
            return None
        return (
            f"WARNING: the reward function {self.fn} failed on {self.failed} of {self.scored} "
            f"rollouts ({self.failed / self.scored:.1%} > config.reward.warn_failure_rate="
            f"{self.warn_rate:g}); those scored the low reward. Its errors: "
            f"{self.path or ERRORS_FILE}"
        )


def _keep_through(path: str, step: int) -> None:
    """Drops the lines of ``path`` whose step is after ``step`` (and a torn last line)."""
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line.rstrip("\n") + "\n")
            except (ValueError, KeyError, TypeError):
                continue
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
