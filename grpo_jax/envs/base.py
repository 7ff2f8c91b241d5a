"""The environment protocol and its registry (`grpo_jax.envs`)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class EnvStep:
    """The environment's answer to one policy turn: ``observation`` (text appended to the
    episode, not trained on; "" for none), ``done`` (the episode ends after it), ``state``
    (the episode's new state, whatever the environment keeps; None = unchanged)."""

    observation: str
    done: bool
    state: Any = None


class Environment:
    """Base class. Class attributes: ``stop_strings`` (texts that end a policy turn and call
    `step`; each must be one token of the tokenizer), ``max_turns`` (policy turns per episode,
    >= 1). Subclasses override `step`, and `reset` / `final_text` when the defaults do not fit.
    Instances are shared by the episodes of a batch (keep per-episode data in ``state``);
    `step` may run on several threads at once."""

    stop_strings: tuple[str, ...] = ()
    max_turns: int = 2

    def reset(self, example: dict) -> Any:
        """The state of a new episode for the dataset row ``example`` (default: the row)."""
        return example

    def step(self, state: Any, turn_text: str) -> EnvStep:
        """The answer to a policy turn that ended with one of ``stop_strings``."""
        raise NotImplementedError

    def demonstration(self, example: dict) -> list[tuple[str, bool]] | None:
        """A worked episode for the supervised warm start: ``[(text, trained), ...]`` after the
        prompt (policy turns ``trained``, observations not; EOS is appended), or None for the
        plain gold answer (the default)."""
        return None

    def final_text(self, state: Any, turns: list[str]) -> str:
        """The text the reward function scores (default: the last policy turn)."""
        return turns[-1] if turns else ""


_ENVIRONMENTS: dict[str, type[Environment]] = {}


def register_environment(name: str):
    """Class decorator: ``config.env.name = name`` selects the class."""

    def deco(cls):
        if name in _ENVIRONMENTS:
            raise ValueError(f"environment {name!r} is already registered")
        _ENVIRONMENTS[name] = cls
        return cls

    return deco
