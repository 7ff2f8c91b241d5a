"""Config checks at the edge: one-line errors that name the field and say what to change."""

from __future__ import annotations

import difflib
import json
import os
from typing import Any

import ml_collections


class ConfigError(ValueError):
    """An invalid or incompatible configuration. The message is one line and names the field."""


def all_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in config.items():
        path = f"{prefix}{k}"
        keys.append(path)
        if isinstance(v, ml_collections.ConfigDict):
            keys.extend(all_keys(v, path + "."))
    return keys


def closest_keys(config: ml_collections.ConfigDict, key: str, n: int = 3) -> list[str]:
    """The valid config keys closest to a misspelled one (by full dotted path and last part)."""
    keys = all_keys(config)
    close = difflib.get_close_matches(key, keys, n=n, cutoff=0.5)
    if not close:
        last = key.split(".")[-1]
        by_last = {k.split(".")[-1]: k for k in keys}
        close = [
            by_last[m] for m in difflib.get_close_matches(last, list(by_last), n=n, cutoff=0.5)
        ]
    return close


_CHOICES = {
    "algorithm.policy_loss_type": ("clip", "cispo", "sapo"),
    "algorithm.ratio_level": ("token", "sequence"),
    "algorithm.estimator": ("grpo", "dr_grpo", "rloo"),
    "algorithm.std": ("unbiased", "population"),
    "algorithm.loss_agg_mode": (
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    ),
    "algorithm.kl_kind": ("k1", "k2", "k3"),
    "algorithm.reward_scale": ("pm1", "01"),
    "data.overlong_prompts": ("skip", "truncate"),
    "data.bad_rows": ("error", "skip"),
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "optimizer.schedule": ("constant", "cosine"),
}

_POSITIVE = (
    "steps",
    "rollout.prompts_per_step",
    "rollout.rollouts_per_prompt",
    "rollout.max_new_tokens",
    "data.max_prompt_tokens",
    "algorithm.num_iterations",
    "checkpoint.every_steps",
    "checkpoint.keep",
    "eval.num_samples",
    "eval.batch_size",
    "logging.every_steps",
)


def _get(config, path):
    for part in path.split("."):
        config = config[part]
    return config


def validate(config: ml_collections.ConfigDict) -> None:
    """Checks choices, ranges and the GDRO constraints.

    Raises:
      ConfigError: naming the field, the bad value and the valid choices or range.
    """
    for path, choices in _CHOICES.items():
        value = _get(config, path)
        if value not in choices:
            raise ConfigError(f"config.{path}={value!r} is not one of {choices}")
    for path in _POSITIVE:
        value = _get(config, path)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"config.{path}={value!r} must be a positive integer")
    # The algorithm, and the controller configs its curriculum builds (they validate their
    # own fields: one source for each range and choice). Only the sections it uses are read.
    from grpo_jax import algorithms  # local: config files import this module without JAX

    name = config.algorithm.name
    if name not in algorithms.names():
        raise ConfigError(
            f"config.algorithm.name={name!r} is not one of {algorithms.names()} "
            "(the names registered in grpo_jax.algorithms)"
        )
    algo = algorithms.get(name)
    try:
        algo.curriculum.config_kwargs(config)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.gdro: {e}") from None
    if config.rollout.rollouts_per_prompt < 2:
        raise ConfigError(
            f"config.rollout.rollouts_per_prompt={config.rollout.rollouts_per_prompt} must be "
            ">= 2 (a group of one rollout has no baseline)"
        )
    if config.algorithm.dynamic_sampling:
        if not algo.curriculum.fixed_group_size:
            raise ConfigError(
                f"config.algorithm.dynamic_sampling needs a fixed group size; {name} varies it "
                "(set dynamic_sampling=False or use an algorithm with equal groups)"
            )
        if config.algorithm.dynamic_sampling_max_rounds < 0:
            raise ConfigError(
                f"config.algorithm.dynamic_sampling_max_rounds="
                f"{config.algorithm.dynamic_sampling_max_rounds} must be >= 0"
            )
    a = config.algorithm
    if a.scale_rewards not in (None, "group", "batch", "none"):
        raise ConfigError(
            f"config.algorithm.scale_rewards={a.scale_rewards!r} is not one of "
            "(None, 'group', 'batch', 'none')"
        )
    if a.dual_clip and a.policy_loss_type != "clip":
        raise ConfigError(
            f"config.algorithm.dual_clip={a.dual_clip} applies to policy_loss_type='clip' only "
            f"(got {a.policy_loss_type!r}); set dual_clip=0"
        )
    if a.tis_cap < 0 or a.overlong_penalty_factor < 0:
        raise ConfigError("config.algorithm.tis_cap and overlong_penalty_factor must be >= 0")
    if (
        a.overlong_penalty_factor
        and not 0 < a.overlong_cache_tokens <= config.rollout.max_new_tokens
    ):
        raise ConfigError(
            f"config.algorithm.overlong_cache_tokens={a.overlong_cache_tokens} must be in "
            f"(0, rollout.max_new_tokens={config.rollout.max_new_tokens}] when "
            "overlong_penalty_factor > 0"
        )
    if config.eval.num_samples < 1:
        raise ConfigError("config.eval.num_samples must be >= 1")
    if not config.rollout.temperature > 0:
        raise ConfigError(
            f"config.rollout.temperature={config.rollout.temperature} must be > 0 (the policy's "
            "log-probs are taken at the sampling temperature; greedy rollouts have no ratio)"
        )
    if config.eval.temperature < 0:
        raise ConfigError(
            f"config.eval.temperature={config.eval.temperature} must be >= 0 (0 = greedy)"
        )
    if not 0 < config.rollout.top_p <= 1:
        raise ConfigError(f"config.rollout.top_p={config.rollout.top_p} must be in (0, 1]")


# Fields that may change between a run and its resume (they do not change the trajectory).
_RESUMABLE = (
    "steps",
    "checkpoint",
    "logging",
    "eval",
    "reward",
    "data.source_dir",
    "model.hf_checkpoint",
    "model.gguf_path",
)


def _comparable(d: dict) -> dict:
    d = json.loads(json.dumps(d, default=str))
    for path in _RESUMABLE:
        parts = path.split(".")
        node = d
        for p in parts[:-1]:
            node = node.get(p, {})
        node.pop(parts[-1], None)
    return d


def check_workdir(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Refuses a workdir that holds a run with an incompatible config (unless overwrite).

    The first call writes ``<workdir>/config.json``; later calls compare against it, ignoring
    fields that do not change the trajectory (steps, checkpoint/logging/eval settings, paths).
    Multi-process runs: every process compares, only process 0 writes (or clears, on
    overwrite), and all of them wait for it before returning.

    Raises:
      ConfigError: naming the first differing field, the workdir and ``config.checkpoint.overwrite``.
    """
    import jax  # local: config files import this module without starting JAX

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        try:
            _check_workdir(config, workdir, write=jax.process_index() == 0)
        finally:  # a refusal on one process is a refusal on all (same files, same config)
            multihost_utils.sync_global_devices("grpo_jax.check_workdir")
        return
    _check_workdir(config, workdir, write=True)


def _check_workdir(config: ml_collections.ConfigDict, workdir: str, write: bool) -> None:
    path = os.path.join(workdir, "config.json")
    new = config.to_dict()
    if os.path.exists(path) and not config.checkpoint.overwrite:
        with open(path) as f:
            old = json.load(f)
        a, b = _comparable(old), _comparable(new)
        if a != b:
            diff = _first_difference(a, b)
            raise ConfigError(
                f"{workdir} holds a run with another config ({diff}); use a new --workdir, or pass "
                "--config.checkpoint.overwrite=True to start over there"
            )
        return
    if not write:
        return
    if os.path.exists(path) and config.checkpoint.overwrite:
        import shutil

        for name in ("checkpoints", "metrics.jsonl", "tensorboard", "summary.json"):
            p = os.path.join(workdir, name)
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(new, f, indent=2, sort_keys=True, default=str)
    os.replace(tmp, path)


def _first_difference(a: Any, b: Any, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
    return f"{prefix.rstrip('.')}: {a!r} -> {b!r}"
