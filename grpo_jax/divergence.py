"""Training that goes wrong while staying finite: an exploding loss or gradient, or no signal.

A non-finite update is skipped in the step itself and stops the run after
``optimizer.max_consecutive_skips`` in a row (`grpo_jax.steps`, `grpo_jax.train`). `DivergenceWatch`
reads the host metrics row of every step (no extra device reads) for the finite failures:

* ``|loss|`` or the pre-clip ``grad_norm`` above ``optimizer.divergence_warn``: one warning line
  per run, naming the step, the quantity and its value (0 = off);
* above ``optimizer.divergence_stop``: `DivergenceError` after the step is checkpointed, so the
  diverged state can be inspected (0 = off);
* a run in which no step had a learning signal (every group's rewards equal, so every advantage
  is 0, e.g. a reward that never varies or a collapsed policy): a warning in its last lines.

Its state travels in the checkpoint's meta (`DivergenceWatch.state`).
"""

from __future__ import annotations

import math

__all__ = ["DivergenceError", "DivergenceWatch"]


class DivergenceError(FloatingPointError):
    """``|loss|`` or ``grad_norm`` passed ``optimizer.divergence_stop`` (finite, but diverged)."""


class DivergenceWatch:
    """See the module docstring.

    Args:
      warn: the bound on ``|loss|`` and ``grad_norm`` that warns once (0 = off).
      stop: the bound that stops the run (0 = off).
      state: a checkpoint's `state` (None: a new run).
    """

    def __init__(self, warn: float, stop: float, state: dict | None = None):
        self.warn, self.stop = float(warn), float(stop)
        s = dict(state or {})
        self.warned = bool(s.get("warned", False))
        self.steps = int(s.get("steps", 0))
        self.steps_with_signal = int(s.get("steps_with_signal", 0))

    def state(self) -> dict:
        """For the checkpoint's meta (JSON-able)."""
        return {
            "warned": self.warned,
            "steps": self.steps,
            "steps_with_signal": self.steps_with_signal,
        }

    def observe(self, step: int, row: dict) -> tuple[list[str], str | None]:
        """Reads one step's metrics row (``loss``, ``grad_norm``, ``advantage_abs_mean``).

        Returns: (lines to print now, the message of a stop or None). A non-finite value is
        the non-finite guard's business and ignored here.
        """
        self.steps += 1
        self.steps_with_signal += int(float(row.get("advantage_abs_mean", 0.0)) > 0)
        worst = self._worst(row)
        if worst is None:
            return [], None
        name, value = worst
        lines = []
        if self.warn and value > self.warn and not self.warned:
            self.warned = True
            lines.append(
                f"WARNING: step {step}: {name} = {value:.4g} > config.optimizer.divergence_warn="
                f"{self.warn:g}: training is diverging (learning rate too high? "
                "config.optimizer.learning_rate / grad_clip); warned once per run"
            )
        if self.stop and value > self.stop:
            return lines, (
                f"step {step}: {name} = {value:.4g} > config.optimizer.divergence_stop="
                f"{self.stop:g}: training diverged; this step is checkpointed for inspection. "
                "Lower config.optimizer.learning_rate (or raise / set 0 divergence_stop)"
            )
        return lines, None

    @staticmethod
    def _worst(row: dict) -> tuple[str, float] | None:
        """The larger of ``|loss|`` and ``grad_norm`` (finite ones only) with its name."""
        found = []
        for name, value in (("|loss|", row.get("loss")), ("grad_norm", row.get("grad_norm"))):
            if isinstance(value, (int, float)) and math.isfinite(value):
                found.append((abs(float(value)), name))
        if not found:
            return None
        value, name = max(found)
        return name, value

    def final_warning(self) -> str | None:
        """The run's closing line when no step had a learning signal (else None)."""
        if not self.steps or self.steps_with_signal:
            return None
        return (
            f"WARNING: none of the run's {self.steps} RL steps had a learning signal: in every "
            "group all rollouts got the same reward, so every advantage was 0 and the policy "
            "gradient was zero (a reward that never varies, a collapsed policy, or too few "
            "rollouts per prompt; see reward_mean and advantage_abs_mean in metrics.jsonl)"
        )
