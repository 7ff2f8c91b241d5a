"""The multi-turn environment of a run's config (``config.env``; `grpo_jax.experiment`)."""

from __future__ import annotations

import dataclasses

from grpo_jax import sampling
from grpo_jax.config_utils import ConfigError
from grpo_jax.envs import episodes, make_environment


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
        stops = episodes.stop_token_ids(tokenizer, env) if tokenizer is not None else ()
    except ValueError as e:
        raise ConfigError(f"env.name={ec.name!r}: {e}") from None
    turn = dataclasses.replace(
        train,
        max_new_tokens=int(ec.turn_tokens or train.max_new_tokens),
        eos_ids=tuple(train.eos_ids) + stops,
        prompt_group_size=1,  # after the first turn a group's rows differ
    )
    return env, turn
