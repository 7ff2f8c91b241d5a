"""The Python API for notebooks and scripts: a config object, a dataset and Python reward
functions in, the run's summary out::

    from grpo_jax import api

    config = api.default_config({"steps": 20, "model.hf_checkpoint": "Qwen/Qwen3-0.6B-Base"})
    # or a typed config: config_schema.RunConfig(steps=20, model=ModelSection(hf_checkpoint=...))
    summary = api.train(
        config,
        dataset=[{"problem": "What is 2+3?", "answer": "5"}, ...],  # or a datasets.Dataset, a path
        reward_fns=[accuracy, brevity],  # batched: fn(completions, answers, ..., **kw) -> floats
        reward_weights=[1.0, 0.1],
        workdir="/tmp/run",
    )

It builds the run the command line builds (`grpo_jax.train.train_and_evaluate`: same config,
same loop, same workdir files); a rerun with the same workdir resumes. Reward functions are
batched (`grpo_jax.rewards.batched`); a callable that pickles from an importable module runs in
the killable worker pool, any other (a closure, a lambda, a notebook's function) in this
process. The name is ``api.train`` because ``grpo_jax.train`` is the training loop's module.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence

import ml_collections

from grpo_jax import config_schema, config_utils, writers
from grpo_jax import train as train_lib
from grpo_jax.errors import ConfigError
from grpo_jax.rewards import batched

__all__ = ["default_config", "train"]


def default_config(overrides: dict | None = None) -> ml_collections.ConfigDict:
    """The schema's defaults (`grpo_jax.config_schema.base_config`, what the CLI's configs start
    from) with ``overrides``: dotted keys -> values, e.g. ``{"steps": 20, "rollout.temperature":
    0.8}``.

    Raises: ConfigError (one line) naming an unknown key and the closest valid ones.
    """
    config = config_schema.base_config()
    valid = set(config_utils.all_keys(config))
    for key, value in (overrides or {}).items():
        if key not in valid:
            close = config_utils.closest_keys(config, key)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}")
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[leaf] = tuple(value) if isinstance(value, list) else value
    return config


def train(
    config: ml_collections.ConfigDict | config_schema.RunConfig,
    *,
    workdir: str,
    dataset=None,
    eval_dataset=None,
    reward_fns: Sequence[Callable | str] | None = None,
    reward_weights: Sequence[float] | None = None,
    allow_changes: Sequence[str] = (),
) -> dict:
    """Trains (or resumes) the run of ``config`` in ``workdir`` and returns its summary.

    Args:
      config: the CLI's config (``configs/*.py``'s ``get_config``, `default_config`) or a
        typed `grpo_jax.config_schema.RunConfig` (e.g. ``RunConfig(steps=20)``; its fields left
        at None are resolved as the CLI's are; a `config_schema.typed` result has them resolved
        already, so build a new one rather than editing that one's source fields, e.g.
        ``rollout.max_new_tokens`` would leave ``eval.max_new_tokens`` at the old value); not
        modified (a copy is edited).
      workdir: checkpoints, ``metrics.jsonl``, ``summary.json`` (and the dataset's rows).
      dataset: the training rows: a list of dicts, a ``datasets.Dataset`` (any iterable of
        dicts), or a path ``config.data.path`` accepts (JSONL / JSON / Parquet / directory /
        ``"hf:org/name"``). Sets ``config.data.name = "custom"``; the columns are
        ``config.data.prompt_column`` / ``answer_column`` (default ``problem`` / ``answer``).
        Rows are written to ``<workdir>/data/train-<hash>.jsonl`` (None: the config's data).
      eval_dataset: the held-out rows, the same kinds (sets ``config.eval.datasets =
        ("custom",)``); None: the config's held-out sets.
      reward_fns: batched reward functions (callables or ``"module:function"``), called once
        per batch (`grpo_jax.rewards.batched`); None: the config's reward.
      reward_weights: one per function (None: all 1).
      allow_changes: as `grpo_jax.train.train_and_evaluate`.

    Returns: the summary dict (`train_and_evaluate`'s).
    Raises: what `train_and_evaluate` raises (ConfigError: a one-line configuration error).
    """
    if isinstance(config, config_schema.RunConfig):
        config = config_schema.to_config_dict(config)
    config = copy.deepcopy(config)
    if dataset is not None:
        config.data.name = "custom"
        config.data.path = _table(dataset, workdir, "train")
    if eval_dataset is not None:
        config.data.eval_path = _table(eval_dataset, workdir, "eval")
        config.eval.datasets = ("custom",)
    callables = {}
    if reward_fns is not None:
        names = []
        for fn in reward_fns:
            if isinstance(fn, str):
                names.append(fn)
                continue
            name, k = f"{batched.CALLABLE_PREFIX}{batched.function_name(fn)}", 2
            while name in callables:
                name, k = f"{batched.CALLABLE_PREFIX}{batched.function_name(fn)}_{k}", k + 1
            callables[name] = fn
            names.append(name)
        config.reward.fn = ""
        config.reward.fns = tuple(names)
        config.reward.weights = tuple(float(w) for w in reward_weights or ())
    elif reward_weights is not None:
        raise ConfigError("reward_weights given without reward_fns")
    return train_lib.train_and_evaluate(
        config, workdir, allow_changes=tuple(allow_changes), reward_callables=callables
    )


def _table(data, workdir: str, split: str) -> str:
    """A path as it is; rows (dicts) written once to ``<workdir>/data/<split>-<hash>.jsonl``
    (the hash of their text, so that other rows never resume this run silently)."""
    if isinstance(data, (str, os.PathLike)):
        return os.fspath(data)
    if not isinstance(data, Iterable):
        raise ConfigError(
            f"the {split} dataset must be a list of dicts, a datasets.Dataset or a path, "
            f"got {type(data).__name__}"
        )
    lines = []
    for i, row in enumerate(data):
        try:
            lines.append(json.dumps(writers.to_jsonable(dict(row)), sort_keys=True) + "\n")
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"the {split} dataset's row {i} is not a dict of JSON values ({e})"
            ) from None
    digest = hashlib.sha256("".join(lines).encode()).hexdigest()[:12]
    path = os.path.join(os.path.abspath(workdir), "data", f"{split}-{digest}.jsonl")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.writelines(lines)
        os.replace(path + ".tmp", path)
    return path
