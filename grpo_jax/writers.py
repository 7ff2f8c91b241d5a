"""Metrics writers: JSONL in the workdir (the source of truth), TensorBoard event files and,
optionally, Weights & Biases (``config.logging.wandb_project``; ``pip install wandb``).

Only process 0 writes. Rows are flat dicts of scalars and short lists (per-bin arrays).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from grpo_jax.errors import ConfigError


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


def _summary_writer_class():
    """tensorboardX's `SummaryWriter`, imported without torch: where torch is installed
    tensorboardX imports it (3.3 s of a 2-core CPU run's start) only to accept torch tensors,
    which grpo_jax never logs. A process that has imported torch already keeps it.

    Raises:
      ImportError: tensorboardX is not installed.
    """
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
    else:
        sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX's probe
        try:
            from tensorboardX import SummaryWriter
        finally:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Appends one JSON object per line to ``<workdir>/metrics.jsonl`` and a step's sample
    completions to ``<workdir>/samples.jsonl`` (+ TensorBoard, W&B).

    On resume, the rows of both files with ``step >= resume_step`` are dropped first, and
    TensorBoard is told to hide its events from that step on (``purge_step``): a run killed
    after writing a step but before its checkpoint leaves no duplicate or missing rows once the
    resumed run has rewritten them (a line torn by a kill mid-write is dropped too). The caller
    writes a step's samples and its row together, so one step bounds both files.
    """

    def __init__(
        self,
        workdir: str,
        *,
        tensorboard: bool = True,
        resume_step: int | None = None,
        wandb: Mapping[str, Any] | None = None,
        run_config: Mapping[str, Any] | None = None,
    ):
        """
        Args:
          workdir: the run's directory.
          tensorboard: also write TensorBoard event files (skipped if tensorboardX is missing).
          resume_step: drop rows (both files) and TensorBoard events with
            ``step >= resume_step`` first (a resumed run: the first step it writes again).
          wandb: ``{"project", "entity", "mode", "name"}`` (``config.logging.wandb_*``); an
            empty project = off. The W&B run id is kept in ``<workdir>/wandb_run_id`` so a
            resumed run continues the same W&B run.
          run_config: the run's config (a plain dict), sent to W&B.

        Raises:
          ConfigError: a W&B project is set but ``wandb`` is not installed.
        """
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.samples_path = os.path.join(workdir, "samples.jsonl")
        self._tb = None
        self._wandb = None
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
                SummaryWriter = _summary_writer_class()
                self._tb = SummaryWriter(
                    os.path.join(workdir, "tensorboard"),
                    purge_step=resume_step,
                    # files are named by the second they are opened in, and opened with "wb": a
                    # writer opened in the same second would erase the last one's events
                    filename_suffix=f".{time.time_ns()}",
                )
            except ImportError:  # optional
                self._tb = None
        if wandb and wandb.get("project"):
            self._wandb = _init_wandb(workdir, wandb, run_config)

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
        if self._wandb is not None:
            scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
            self._wandb.log(scalars, step=int(step))

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
        if self._wandb is not None:
            import wandb

            cols = ["prompt", "completion", "answer", "reward"]
            data = [[str(to_jsonable(x.get(c, ""))) for c in cols] for x in samples]
            self._wandb.log({"samples": wandb.Table(columns=cols, data=data)}, step=int(step))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _init_wandb(workdir: str, cfg: Mapping[str, Any], run_config: Mapping[str, Any] | None):
    """``wandb.init`` for this workdir: the same run id on every resume (``wandb_run_id``)."""

    try:
        import wandb
    except ImportError:
        raise ConfigError(
            f"config.logging.wandb_project={cfg['project']!r} but wandb is not installed: "
            "pip install wandb, or set config.logging.wandb_project=''"
        ) from None
    id_path = os.path.join(workdir, "wandb_run_id")
    if os.path.exists(id_path):
        with open(id_path) as f:
            run_id = f.read().strip()
    else:
        run_id = uuid.uuid4().hex[:16]
        with open(id_path + ".tmp", "w") as f:
            f.write(run_id + "\n")
        os.replace(id_path + ".tmp", id_path)
    return wandb.init(
        project=cfg["project"],
        entity=cfg.get("entity") or None,
        name=cfg.get("name") or os.path.basename(os.path.abspath(workdir)),
        mode=cfg.get("mode") or None,
        id=run_id,
        resume="allow",
        dir=workdir,
        config=dict(run_config or {}),
    )


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
