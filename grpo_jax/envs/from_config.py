"""The multi-turn environment of a run's config (``config.env``; `grpo_jax.experiment`)."""

from __future__ import annotations

import dataclasses

from grpo_jax import sampling
from grpo_jax.envs import episodes, make_environment
from grpo_jax.errors import ConfigError


def environment(config, tokenizer, train: sampling.SamplingConfig):
    """(environment, one turn's `sampling.SamplingConfig`) of ``config.env``; (None, None)
    without one. Raises ConfigError (one line) for a bad name, turn count or stop string."""
    ec = config.env
    if not ec.name:
        return None, None
    env = make_environment(ec.name)
    if int(ec.max_turns) < 1:
        raise ConfigError(f"env.max_turns must be >= 1, got {ec.max_turns}")
    env.max_turns = int(ec.max_turns)
    try:
        turn = turn_sampling(train, tokenizer, env, int(ec.turn_tokens)) if tokenizer else None
    except ValueError as e:
        raise ConfigError(f"env.name={ec.name!r}: {e}") from None
    return env, turn


def turn_sampling(config: sampling.SamplingConfig, tokenizer, env, turn_tokens: int = 0):
    """One policy turn's `sampling.SamplingConfig`: ``config`` with at most ``turn_tokens``
    tokens (0 = ``config.max_new_tokens``), the environment's stop tokens added to the end ids
    and one row per prompt (after the first turn a group's rows differ); None without ``env``.
    Raises ValueError for a stop string that is not one token."""
    if env is None:
        return None
    return dataclasses.replace(
        config,
        max_new_tokens=int(turn_tokens or config.max_new_tokens),
        eos_ids=tuple(config.eos_ids) + episodes.stop_token_ids(tokenizer, env),
        prompt_group_size=1,
    )
