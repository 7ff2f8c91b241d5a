"""Config checks at the edge: one-line errors that name the field and say what to change."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import shutil
from typing import Any

import jax
import ml_collections

from grpo_jax import algorithms, config_schema
from grpo_jax.errors import ConfigError
from grpo_jax.models import config as model_config_lib


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
    "algorithm.reward_scale": ("pm1", "01"),
    "data.overlong_prompts": ("skip", "truncate"),
    "data.bad_rows": ("error", "skip"),
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "optimizer.schedule": ("constant", "cosine"),
}

# grpo_jax.models.config.ATTENTION_IMPLS (not imported: that package starts JAX)
ATTENTION_IMPLS = ("auto", "einsum", "blockwise", "splash", "cudnn")
# grpo_jax.models.transformer.DECODE_CACHES' names (not imported: it starts JAX)
DECODE_CACHES = ("dense", "prefix_shared", "paged")

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
    impl = config.model.attention_impl
    if impl not in ATTENTION_IMPLS:
        raise ConfigError(f"config.model.attention_impl={impl!r} is not one of {ATTENTION_IMPLS}")
    for path in _POSITIVE:
        value = _get(config, path)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"config.{path}={value!r} must be a positive integer")
    _validate_algorithm(config)
    _validate_data_and_sampling(config)
    _validate_ranges(config)
    _validate_reward_model(config)


def _validate_algorithm(config) -> None:
    """The algorithm's name, its curriculum's controller configs, the loss and advantage
    options (their own configs validate them) and the DAPO options."""
    # The algorithm, and the controller configs its curriculum builds (they validate their
    # own fields: one source for each range and choice). Only the sections it uses are read.

    name = config.algorithm.name
    if name not in algorithms.names():
        raise ConfigError(
            f"config.algorithm.name={name!r} is not one of {algorithms.names()} "
            "(the names registered in grpo_jax.algorithms)"
        )
    algo = algorithms.get(name)
    try:  # the option dataclasses' own checks (loss, advantages, GDRO, curricula), once
        run = config_schema.typed(config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:  # what the curriculum derives from them (e.g. Rollout-GDRO's n_bar in its range)
        algo.curriculum.config_kwargs(run)
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
    _validate_staleness(config, algo)

    if a.overlong_penalty_factor < 0:
        raise ConfigError("config.algorithm.overlong_penalty_factor must be >= 0")
    kl_in = a.get("kl_in")
    if kl_in is not None and kl_in not in algo.learner.kl_in_choices:
        raise ConfigError(
            f"config.algorithm.kl_in={kl_in!r} is not one of "
            f"{(None, *algo.learner.kl_in_choices)} for algorithm {name!r}"
            + ("" if kl_in not in ("reward", "loss") else " (only ppo has per-token rewards)")
        )
    if (
        a.overlong_penalty_factor
        and not 0 < a.overlong_cache_tokens <= config.rollout.max_new_tokens
    ):
        raise ConfigError(
            f"config.algorithm.overlong_cache_tokens={a.overlong_cache_tokens} must be in "
            f"(0, rollout.max_new_tokens={config.rollout.max_new_tokens}] when "
            "overlong_penalty_factor > 0"
        )


def _validate_staleness(config, algo) -> None:
    """``rollout.max_staleness`` >= 1 (rollouts in flight, `grpo_jax.rollout_queue`): the
    off-policy gap needs the TIS correction, and a step trains on one batch generated ahead."""
    k = config.rollout.max_staleness
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        return  # 0, or a bad value (_validate_ranges names it)
    if not config.algorithm.tis_cap:
        raise ConfigError(
            f"config.rollout.max_staleness={k} trains on rollouts of parameters up to {k} "
            "update(s) old; set config.algorithm.tis_cap (e.g. 2) for the truncated importance "
            "sampling that corrects the gap"
        )
    if config.env.name:
        raise ConfigError(
            f"config.rollout.max_staleness={k} with config.env.name={config.env.name!r}: "
            "multi-turn episodes run their turns on the host and cannot be generated ahead yet "
            "(set max_staleness=0)"
        )
    if config.algorithm.dynamic_sampling or algo.curriculum.filters_groups:
        raise ConfigError(
            f"config.rollout.max_staleness={k} generates one batch per step ahead of its "
            f"update; algorithm {config.algorithm.name!r} with dynamic_sampling="
            f"{config.algorithm.dynamic_sampling} samples extra rounds after scoring (set "
            "max_staleness=0, or dynamic_sampling=False with a curriculum that keeps every group)"
        )


def _validate_data_and_sampling(config) -> None:
    """Conversational data and the sampling settings of training and evaluation."""
    messages = config.data.messages_column
    if messages and config.data.name != "custom":
        raise ConfigError(
            f"config.data.messages_column={messages!r} applies to your own table "
            f"(data.name='custom'), not the preset {config.data.name!r}"
        )
    if messages and config.data.template != "chat":
        raise ConfigError(
            f"config.data.messages_column={messages!r}: conversations render through the "
            f"tokenizer's chat template; set config.data.template='chat' (got "
            f"{config.data.template!r})"
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
    cache = config.rollout.decode_cache
    if cache not in DECODE_CACHES:
        raise ConfigError(f"config.rollout.decode_cache={cache!r} is not one of {DECODE_CACHES}")
    if not isinstance(config.rollout.page_size, int) or config.rollout.page_size < 1:
        raise ConfigError(
            f"config.rollout.page_size={config.rollout.page_size!r} must be an int >= 1"
        )
    if cache != "dense" and config.rollout.decode_slots:
        raise ConfigError(
            f"config.rollout.decode_cache={cache!r} takes static batching; set "
            f"config.rollout.decode_slots=0 (got {config.rollout.decode_slots})"
        )


def _validate_reward_model(config) -> None:
    """The ``config.reward.model*`` fields (read only when a reward model is set)."""
    r = config.reward
    if not r.get("model", ""):
        return
    inf = math.inf
    for path in ("reward.model_weight", "reward.verifier_weight"):
        _num(config, path, -inf, inf, lo_open=True, hi_open=True)
    if r.model_weight == 0:
        raise ConfigError(
            f"config.reward.model_weight=0 with config.reward.model={r.model!r}: the reward model "
            "would be loaded and ignored (set a weight, or model='' for no reward model)"
        )
    if r.model_template not in ("text", "chat"):
        raise ConfigError(
            f"config.reward.model_template={r.model_template!r} is not one of ('text', 'chat')"
        )
    if r.model_dtype not in (None, "float32", "bfloat16"):
        raise ConfigError(
            f"config.reward.model_dtype={r.model_dtype!r} is not one of (None, 'float32', "
            "'bfloat16') (None = config.model.dtype)"
        )
    for path in ("reward.model_max_tokens", "reward.model_batch_size"):
        _num(config, path, 0, integer=True)


def _num(config, path, lo=None, hi=None, *, lo_open=False, hi_open=False, integer=False):
    """Checks ``config.<path>`` is a (finite unless hi is inf) number in the given range."""
    value = _get(config, path)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and integer:
        ok = isinstance(value, int)
    if ok:
        ok = not math.isnan(value)
        if lo is not None:
            ok = ok and (value > lo if lo_open else value >= lo)
        if hi is not None:
            ok = ok and (value < hi if hi_open else value <= hi)
    if not ok:
        lo_s = "" if lo is None else ("(" if lo_open else "[") + f"{lo}, "
        hi_s = "inf)" if hi is None else f"{hi}" + (")" if hi_open else "]")
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"config.{path}={value!r} must be {kind} in {lo_s or '(-inf, '}{hi_s}")


def _validate_ranges(config) -> None:
    """Every numeric field of configs/common.py a run reads, against the range it can run with
    (a value outside it fails later, after the warm start, or silently means something else)."""
    inf = math.inf
    for path, lo, integer in (
        ("seed", 0, True),  # numpy generators (data order, warm-start batches) need >= 0
        ("data.max_train_examples", 0, True),
        ("rollout.generate_batch_size", 0, True),
        ("rollout.max_staleness", 0, True),
        ("rollout.top_k", 0, True),
        ("algorithm.mini_batch_size", 0, True),
        ("algorithm.micro_batch_size", 0, True),
        ("algorithm.overlong_cache_tokens", 0, True),
        ("optimizer.warmup_steps", 0, True),
        ("optimizer.weight_decay", 0, False),
        ("optimizer.grad_clip", 0, False),
        ("sft.steps", 0, True),
        ("eval.every_steps", 0, True),
        ("eval.max_examples", 0, True),
        ("eval.top_k", 0, True),
        ("mesh.num_devices", 0, True),
        ("ppo.value_clip", 0, False),
        ("ppo.vf_coef", 0, False),
        ("ppo.critic_lr", 0, False),
        ("reward.float_rounding", 0, True),
    ):
        _num(config, path, lo, integer=integer)
    n = config.eval.max_new_tokens
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ConfigError(
            f"config.eval.max_new_tokens={n!r} must be a positive integer, or None for "
            "rollout.max_new_tokens"
        )
    if "logprob_chunk_size" in config.algorithm:  # older configs (a workdir's) lack it
        _num(config, "algorithm.logprob_chunk_size", 0, integer=True)
    # learning rates: >= 0 (inf is allowed: it is how the non-finite-update guard is tested)
    for path in ("optimizer.learning_rate", "sft.learning_rate"):
        _num(config, path, 0, inf)
    for path in ("optimizer.b1", "optimizer.b2"):
        _num(config, path, 0, 1, hi_open=True)
    for path in ("ppo.gamma", "ppo.lam", "eval.top_p"):
        _num(config, path, 0, 1)
    _num(config, "reward.timeout_s", 0, lo_open=True)
    _num(config, "reward.max_failed_steps", 0, integer=True)
    _num(config, "reward.warn_failure_rate", 0, 1)
    _num(config, "optimizer.max_consecutive_skips", 1, integer=True)
    for path in ("optimizer.divergence_warn", "optimizer.divergence_stop"):
        _num(config, path, 0)  # 0 = off
    _num(config, "reward.num_workers", 1, integer=True)
    _num(config, "reward.numeric_precision", 1, integer=True)
    _num(config, "reward.format_reward", -inf, inf, lo_open=True, hi_open=True)
    if config.sft.steps > 0:
        _num(config, "sft.batch_size", 1, integer=True)
    for axis in ("data", "fsdp", "tensor"):  # -1: all remaining devices (at most one axis)
        if config.mesh[axis] != -1:
            _num(config, f"mesh.{axis}", 1, integer=True)

    fields = {f.name for f in dataclasses.fields(model_config_lib.ModelConfig)}
    if config.model.preset not in model_config_lib.PRESETS and not (
        config.model.hf_checkpoint or config.model.gguf_path
    ):
        raise ConfigError(
            f"config.model.preset={config.model.preset!r} is not one of "
            f"{sorted(model_config_lib.PRESETS)}"
        )
    _num(config, "model.first_layers", 0, integer=True)
    if config.model.first_layers and not (config.model.hf_checkpoint or config.model.gguf_path):
        raise ConfigError(
            f"config.model.first_layers={config.model.first_layers} keeps a checkpoint's first "
            "layers; set config.model.hf_checkpoint or config.model.gguf_path, or "
            "config.model.overrides.num_layers for a preset"
        )
    for key in config.model.overrides:
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=3)
            raise ConfigError(
                f"config.model.overrides.{key} is not a ModelConfig field"
                + (f" (did you mean {', '.join(close)}?)" if close else "")
            )


# THE list of fields that may change between a run and its resume: they do not change what the
# run computes (total steps, the evaluation / logging / checkpoint schedule, paths, worker
# counts, timeouts). Every other field changes the trajectory or what is measured (reward,
# data, model, algorithm, optimizer, rollout sampling, seed, gdro, ppo, sft, mesh, the
# evaluation protocol) and a resume that changes it is refused, unless the field (or its
# section) is named in ``allow_changes`` (`experiments/run.py --allow_changes=a.b,c`).
SAFE_TO_CHANGE = (
    "steps",  # not with optimizer.schedule='cosine' (the schedule's length), see config_changes
    "checkpoint.every_steps",
    "checkpoint.keep",
    "checkpoint.overwrite",
    "logging",
    "eval.every_steps",
    "data.source_dir",
    "data.tfds_data_dir",
    "data.use_tfds",  # the TFDS path reads the same examples (tests/test_byo.py)
    "model.hf_checkpoint",
    "model.tokenizer",
    "model.gguf_path",
    "model.attention_impl",  # the same attention up to float rounding (tests/test_attention_impl.py)
    "reward.num_workers",
    "reward.timeout_s",
    "reward.batch_timeout_s",
    "reward.max_failed_steps",  # when a failing reward stops the run, not what it computes
    "reward.warn_failure_rate",
    "optimizer.divergence_warn",  # when a diverging run warns or stops, not what it computes
    "optimizer.divergence_stop",
)


def _leaves(d: Any, prefix: str = "") -> dict:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): d}


def _covered(path: str, names) -> bool:
    return any(path == n or path.startswith(n + ".") for n in names)


def _normalised(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))  # tuples -> lists, as stored in JSON


def _resolved_leaves(config) -> dict:
    """Dotted path -> value of the schema's fields as `config_schema.typed` resolves them
    (empty for a config it refuses)."""
    try:
        run = config_schema.to_config_dict(config_schema.typed(config))
    except (ValueError, TypeError, KeyError):
        return {}
    return _leaves(_normalised(run.to_dict()))


def config_changes(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """The fields that differ between two config dicts and are not in `SAFE_TO_CHANGE`:
    ``[(dotted path, old value, new value)]`` in path order. Both are read on today's schema
    (`config_schema.upgrade`), so a field added since an older run's config was written counts
    as its default, not as a change. A field left at None on one side and set on the other
    compares as the value None resolves to (`config_schema.typed`: ``algorithm.kl_in`` None and
    ``"loss"`` are the same GRPO run); left at None on both sides it is no change (a change of
    the field it follows is reported there, once)."""
    old_c, new_c = config_schema.upgrade(old), config_schema.upgrade(new)
    a, b = (_leaves(_normalised(c.to_dict())) for c in (old_c, new_c))
    ra, rb = _resolved_leaves(old_c), _resolved_leaves(new_c)
    cosine = "cosine" in (a.get("optimizer.schedule"), b.get("optimizer.schedule"))
    out = []
    for path in sorted(set(a) | set(b)):
        va, vb = a.get(path), b.get(path)
        if va == vb:
            continue
        if (va is None) != (vb is None) and path in ra and path in rb:
            va, vb = ra[path], rb[path]  # None against a value: what None stands for
            if va == vb:
                continue
        if _covered(path, SAFE_TO_CHANGE) and not (path == "steps" and cosine):
            continue
        out.append((path, va, vb))
    return out


def check_resume(
    old: dict, new: dict, where: str, allow_changes=(), *, what: str = "a run"
) -> list[str]:
    """Refuses ``new`` where ``old`` ran, unless every trajectory change is in ``allow_changes``.

    Returns: the allowed changes made (``"path: old -> new"``), to be recorded with the run.
    Raises: ConfigError listing the changes (the first five) and the ways out.
    """
    changes = config_changes(old, new)
    refused = [c for c in changes if not _covered(c[0], allow_changes)]
    if refused:
        text = [f"{p}: {a!r} -> {b!r}" for p, a, b in refused]
        more = f"; and {len(text) - 5} more" if len(text) > 5 else ""
        fields = ",".join(p for p, _, _ in refused)
        raise ConfigError(
            f"{where} holds {what} with another config ({'; '.join(text[:5])}{more}); use a new "
            "--workdir, or pass --config.checkpoint.overwrite=True to start over there, or "
            f"--allow_changes={fields} to continue this run with the change"
        )
    return [f"{p}: {a!r} -> {b!r}" for p, a, b in changes]


def saved_config(checkpoints_dir: str) -> tuple[int, dict] | None:
    """``(step, config dict)`` stored in the newest complete checkpoint's meta, read as plain
    JSON (no Orbax, no model); None when there is none (or none holds a config)."""
    try:
        names = os.listdir(checkpoints_dir)
    except OSError:
        return None
    for step in sorted((int(n) for n in names if n.isdigit()), reverse=True):
        try:
            with open(os.path.join(checkpoints_dir, str(step), "meta", "metadata")) as f:
                config = json.load(f).get("config")
        except (OSError, ValueError, AttributeError):
            continue  # unreadable: restore_latest reports it and falls back the same way
        if config is not None:
            return step, config
    return None


def check_workdir(
    config: ml_collections.ConfigDict, workdir: str, allow_changes=(), *, processes=None
) -> list[str]:
    """Refuses a workdir that holds a run with an incompatible config (unless overwrite).

    The first call writes ``<workdir>/config.json``; later calls compare against it and against
    the config stored in the newest checkpoint (the copy that counts; it stands in for a
    missing config.json), ignoring `SAFE_TO_CHANGE` and the fields in ``allow_changes``.
    Multi-process runs: every process compares, only process 0 writes (or clears, on
    overwrite), and all of them wait for it before returning. ``processes``: the process
    indices that run it (default: every process of the job; a two-group run passes its
    training group, which must then be one process: the barrier spans the whole job).

    Returns: the allowed changes (``"path: old -> new"``; empty for a new or unchanged run).
    Raises:
      ConfigError: naming the differing fields, the workdir, ``config.checkpoint.overwrite`` and
      ``--allow_changes``.
    """

    if processes is not None and len(processes) > 1:
        raise ValueError("check_workdir: a group of several processes is not supported")
    if processes is None and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        try:
            return _check_workdir(config, workdir, allow_changes, write=jax.process_index() == 0)
        finally:  # a refusal on one process is a refusal on all (same files, same config)
            multihost_utils.sync_global_devices("grpo_jax.check_workdir")
    return _check_workdir(config, workdir, allow_changes, write=True)


def _check_workdir(config, workdir: str, allow_changes, write: bool) -> list[str]:
    path = os.path.join(workdir, "config.json")
    new = config.to_dict()
    changes = []
    if not config.checkpoint.overwrite:
        if os.path.exists(path):
            try:
                with open(path) as f:
                    old = json.load(f)
            except (OSError, ValueError) as e:
                raise ConfigError(
                    f"{path} cannot be read ({type(e).__name__}: {' '.join(str(e).split())}); "
                    "remove it to use the copy stored in the checkpoints"
                ) from None
            changes = check_resume(old, new, workdir, allow_changes)
        saved = saved_config(os.path.join(workdir, "checkpoints"))
        if saved is not None:
            changes = check_resume(saved[1], new, workdir, allow_changes) or changes
        if os.path.exists(path) and not changes:
            return []
    if not write:
        return changes
    if config.checkpoint.overwrite:
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
    return changes


def first_difference(a: Any, b: Any, prefix: str = "") -> str:
    """The first field (sorted paths) where the JSON-like trees ``a`` and ``b`` differ, as
    ``"path: a -> b"``; call it only when they differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
    return f"{prefix.rstrip('.')}: {a!r} -> {b!r}"
