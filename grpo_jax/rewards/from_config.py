"""The rewards of a run, built from its config (``config.reward``).

`make_reward_fns(config)` gives the training reward and one per held-out set; sets scored the
same way share one function (and its verifier worker pool). With ``config.reward.model`` the
training reward is `grpo_jax.rewards.model.ModelReward` (the verifier plus a learned reward
model on the mesh); the held-out sets are scored by the verifiers alone.
"""

from __future__ import annotations

import math

from grpo_jax import sharding
from grpo_jax.errors import ConfigError
from grpo_jax.rewards import RewardConfig, RewardFn, batched, custom
from grpo_jax.rewards import model as model_lib


def reward_task(dataset: str, config=None) -> str:
    """The verifier for a dataset: exact integers (arithmetic), GSM8K numbers, or LaTeX math.
    With ``config``, ``config.reward.task`` (if set) overrides it for the training data and
    ``"custom"`` held-out rows."""
    if config is not None and dataset in (config.data.name, "custom"):
        task = config.reward.task
        if task:
            return task
    return {"arithmetic": "arithmetic", "gsm8k": "gsm8k"}.get(dataset, "math")


def reward_key(config, dataset: str | None = None) -> tuple:
    """What scores a dataset: ("fn", "module:function"), ("fns", names, weights) or ("task",
    task); equal keys share one reward function (and its worker pool)."""
    dataset = dataset or config.data.name
    r = config.reward
    if dataset in (config.data.name, "custom"):
        if getattr(r, "fns", ()):
            return ("fns", tuple(r.fns), tuple(r.weights))
        if r.fn:
            return ("fn", r.fn)
    return ("task", reward_task(dataset, config))


def check_functions(config, callables=None) -> None:
    """Imports ``config.reward.fn``, ``config.reward.fns`` and ``config.reward.extract``
    (``"module:function"``) in this process, so that a typo or an import error fails with the
    config checks, before any data or weights load; checks ``reward.weights`` against
    ``reward.fns`` and that every ``"callable:<name>"`` of ``reward.fns`` is in ``callables``
    (name -> callable, the Python API's).

    Raises: ConfigError naming the field, the spec and the problem.
    """
    r = config.reward
    fns, weights = tuple(getattr(r, "fns", ())), tuple(getattr(r, "weights", ()))
    if fns and r.fn:
        raise ConfigError("config.reward.fn and config.reward.fns are both set; use one of them")
    if weights and len(weights) != len(fns):
        raise ConfigError(
            f"config.reward.weights has {len(weights)} values for {len(fns)} reward.fns "
            "(give one weight per function, or none for all 1)"
        )
    if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights):
        raise ConfigError(f"config.reward.weights must be finite numbers, got {weights}")
    names = [batched.function_name(f) for f in fns]
    if len(set(names)) != len(names):
        raise ConfigError(f"config.reward.fns: the functions' names must be unique, got {names}")
    for spec in fns:
        if spec.startswith(batched.CALLABLE_PREFIX):
            if spec not in (callables or {}):
                raise ConfigError(
                    f"config.reward.fns: {spec!r} names a Python callable given to "
                    "grpo_jax.api.train; pass it again there (reward_fns=[...])"
                )
            continue
        try:
            custom.resolve_callable(spec)
        except ValueError as e:
            raise ConfigError(f"config.reward.fns: {e}") from None
    for field, what in (("fn", "reward function"), ("extract", "answer extractor")):
        spec = getattr(config.reward, field, "")
        if spec:
            try:
                custom.resolve_callable(spec, what)
            except ValueError as e:
                raise ConfigError(f"config.reward.{field}: {e}") from None


def make_reward_fn(config, dataset: str | None = None, callables=None):
    """The reward of a dataset (default: the training data): ``config.reward.fns`` (batched,
    weighted: `grpo_jax.rewards.batched.BatchedRewards`; ``callables`` maps the Python API's
    ``"callable:<name>"`` entries to the callables), ``config.reward.fn`` (your own per-row
    function, `grpo_jax.rewards.custom.UserRewardFn`) or the built-in verifier of its task."""
    r = config.reward
    kind, value, *weights = reward_key(config, dataset)
    common = dict(  # what a function of yours shares with the built-in verifier's pool
        timeout_s=r.timeout_s,
        num_workers=r.num_workers,
        scale=config.algorithm.reward_scale,
        correct_above=r.correct_above,
        format_reward=r.format_reward,
        format_pattern=r.format_pattern,
        extract=r.extract,
        task=r.task or "math",
    )
    if kind == "fns":
        check_functions(config, callables)
        fns = [(callables or {}).get(f, f) for f in value]
        try:
            return batched.BatchedRewards(
                fns,
                weights[0],
                names=[batched.function_name(f) for f in value],
                batch_timeout_s=r.batch_timeout_s,
                **common,
            )
        except ValueError as e:
            raise ConfigError(f"config.reward.fns: {e}") from None
    if kind == "fn":
        try:
            return custom.UserRewardFn(
                value,
                **common,
            )
        except ValueError as e:
            raise ConfigError(f"config.reward.fn: {e}") from None
    fn = RewardFn(
        RewardConfig(
            task=value,
            scale=config.algorithm.reward_scale,
            format_reward=r.format_reward,
            timeout_s=r.timeout_s,
            num_workers=r.num_workers,
            numeric_precision=r.numeric_precision,
            float_rounding=r.float_rounding,
            format_pattern=r.format_pattern,
        )
    )
    extract = r.extract
    if extract:
        try:
            fn.extract = custom.resolve_callable(extract, "answer extractor")
        except ValueError as e:
            raise ConfigError(f"config.reward.extract: {e}") from None
    return fn


def make_model_reward(config, verifier, mesh):
    """``verifier`` combined with the reward model of ``config.reward.model`` on ``mesh``
    (`grpo_jax.rewards.model.ModelReward`).

    Raises: ConfigError naming config.reward.model (missing files, not a one-label
    sequence-classification checkpoint, unsupported architecture) or the batch size field.
    """
    r = config.reward
    div = sharding.batch_divisor(mesh)
    if r.model_batch_size % div:
        raise ConfigError(
            f"config.reward.model_batch_size={r.model_batch_size} must be a multiple of the "
            f"mesh's data x fsdp = {div} (0 = all rollouts at once)"
        )
    platform = mesh.devices.flat[0].platform
    try:
        scorer = model_lib.RewardModelScorer.load(
            r.model,
            mesh,
            dtype=r.model_dtype or config.model.dtype,
            platform=platform,
            batch_size=r.model_batch_size,
            max_tokens=r.model_max_tokens,
            template=r.model_template,
        )
    except (FileNotFoundError, ValueError, OSError) as e:
        msg = " ".join(str(e).split())
        raise ConfigError(f"config.reward.model={r.model!r}: {msg}") from None
    return model_lib.ModelReward(
        verifier, scorer, model_weight=r.model_weight, verifier_weight=r.verifier_weight
    )


def make_reward_fns(config, eval_names=(), mesh=None, callables=None) -> tuple:
    """(training reward, {held-out set name: its reward}); equal `reward_key`s share one
    function. With ``config.reward.model`` (needs ``mesh``) the training reward adds the
    reward model's score (`make_model_reward`) and held-out sets keep the verifier. The caller
    closes them (``close()``). ``callables``: as `make_reward_fn`."""
    verifier = make_reward_fn(config, callables=callables)
    shared = {reward_key(config): verifier}
    train = verifier
    if getattr(config.reward, "model", ""):
        try:
            train = make_model_reward(config, verifier, mesh)
        except BaseException:
            verifier.close()
            raise
    evals = {}
    for name in eval_names:
        key = reward_key(config, name)
        if key not in shared:
            shared[key] = make_reward_fn(config, name, callables)
        evals[name] = shared[key]
    return train, evals
