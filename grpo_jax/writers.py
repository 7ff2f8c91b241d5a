"""Metrics writers: JSONL in the workdir (the source of truth) and TensorBoard event files.

Only process 0 writes. Rows are flat dicts of scalars and short lists (per-bin arrays).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


def to_jsonable(value: Any) -> Any:
    """numpy/JAX scalars and arrays -> Python floats/ints/lists (NaN/inf kept as strings)."""
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        value = np.asarray(value).tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {k: to_jsonable(v) for k, v in value.items()}
    return value


class MetricsWriter:
    """Appends one JSON object per line to ``<workdir>/metrics.jsonl`` (+ TensorBoard).

    On resume, rows with ``step >= resume_step`` are dropped first, so a run that is killed
    after writing a row but before its checkpoint leaves no duplicate rows (and a line torn by
    a kill mid-write is dropped too).
    """

    def __init__(self, workdir: str, *, tensorboard: bool = True, resume_step: int | None = None):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.samples_path = os.path.join(workdir, "samples.jsonl")
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        for path in (self.path, self.samples_path):
            if resume_step is not None and os.path.exists(path):
                with open(path) as f:
                    rows = [line.rstrip("\n") + "\n" for line in f if _step_of(line) < resume_step]
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    f.writelines(rows)
                os.replace(tmp, path)
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
            except ImportError:  # optional
                self._tb = None

    def write(self, step: int, row: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: to_jsonable(v) for k, v in row.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def write_samples(self, step: int, samples: list[dict]) -> None:
        """Appends sample completions (dicts of prompt, completion, answer, reward) to
        ``samples.jsonl``, one line per sample, and to TensorBoard as text."""
        if not self.enabled or not samples:
            return
        with open(self.samples_path, "a") as f:
            for x in samples:
                f.write(json.dumps({"step": int(step), **to_jsonable(x)}, sort_keys=True) + "\n")
        if self._tb is not None:
            text = "\n\n".join(
                f"**{x.get('reward')}** `{x.get('prompt', '')}` → `{x.get('completion', '')}` "
                f"(gold `{x.get('answer', '')}`)"
                for x in samples
            )
            self._tb.add_text("samples", text, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _step_of(line: str) -> float:
    """A row's step; +inf for a blank or torn line (a process killed mid-write), which is dropped."""
    try:
        return json.loads(line).get("step", -1)
    except (json.JSONDecodeError, AttributeError):
        return math.inf


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a/b": 1}."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = v
    return out
