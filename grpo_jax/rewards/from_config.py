"""The rewards of a run, built from its config (``config.reward``).

`make_reward_fns(config)` gives the training reward and one per held-out set; sets scored the
same way share one function (and its verifier worker pool).
"""

from __future__ import annotations

from grpo_jax.config_utils import ConfigError
from grpo_jax.rewards import RewardConfig, RewardFn, custom


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
    """What scores a dataset: ("fn", "module:function") or ("task", task); equal keys share
    one reward function (and its worker pool)."""
    dataset = dataset or config.data.name
    fn = config.reward.fn
    if fn and dataset in (config.data.name, "custom"):
        return ("fn", fn)
    return ("task", reward_task(dataset, config))


def make_reward_fn(config, dataset: str | None = None):
    """The reward of a dataset (default: the training data): ``config.reward.fn`` (your own
    function, `grpo_jax.rewards.custom.UserRewardFn`) or the built-in verifier of its task."""
    r = config.reward
    kind, value = reward_key(config, dataset)
    if kind == "fn":
        try:
            return custom.UserRewardFn(
                value,
                timeout_s=r.timeout_s,
                num_workers=r.num_workers,
                scale=config.algorithm.reward_scale,
                correct_above=r.correct_above,
                format_reward=r.format_reward,
                format_pattern=r.format_pattern,
                extract=r.extract,
                task=r.task or "math",
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


def make_reward_fns(config, eval_names=()) -> tuple:
    """(training reward, {held-out set name: its reward}); equal `reward_key`s share one
    function. The caller closes them (``close()``)."""
    train = make_reward_fn(config)
    shared = {reward_key(config): train}
    evals = {}
    for name in eval_names:
        key = reward_key(config, name)
        if key not in shared:
            shared[key] = make_reward_fn(config, name)
        evals[name] = shared[key]
    return train, evals
