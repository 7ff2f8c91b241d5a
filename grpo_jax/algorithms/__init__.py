"""Algorithms by name: each is a curriculum (what to train on) and a learner (how to train).

    algorithms.get("prompt_gdro")  ->  Algorithm(curriculum=PromptGDRO, learner=Learner)

`config.algorithm.name` is looked up here, and only here; `names()` is the one list of valid
choices. A new curriculum is one `Curriculum` subclass and one `register` call (worked example:
docs/architecture.md).
"""

from __future__ import annotations

import dataclasses

from grpo_jax.algorithms.base import (
    Curriculum,
    CurriculumState,
    Learner,
    Placement,
    StepOutcome,
    Visit,
)
from grpo_jax.algorithms.field import (
    GRESO,
    DynamicSampling,
    LearnabilitySampling,
    OnlineDifficultyFilter,
)
from grpo_jax.algorithms.gdro import PromptGDRO, RolloutGDRO
from grpo_jax.algorithms.ppo import PPO, PPOBatch, PPOState


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A registered algorithm: its curriculum class and its learner class."""

    name: str
    curriculum: type[Curriculum]
    learner: type[Learner]


_REGISTRY: dict[str, Algorithm] = {}


def register(
    name: str,
    *,
    curriculum: type[Curriculum] = Curriculum,
    learner: type[Learner] = Learner,
    replace: bool = False,
) -> Algorithm:
    """Registers ``name`` (the value of ``config.algorithm.name``).

    Raises:
      ValueError: ``name`` is taken (pass ``replace=True`` to override).
    """
    if name in _REGISTRY and not replace:
        raise ValueError(f"algorithm {name!r} is already registered")
    _REGISTRY[name] = Algorithm(name=name, curriculum=curriculum, learner=learner)
    return _REGISTRY[name]


def get(name: str) -> Algorithm:
    """The algorithm registered as ``name``.

    Raises:
      ValueError: unknown name (the message lists the registered ones).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; registered: {', '.join(names())}")
    return _REGISTRY[name]


def names() -> tuple[str, ...]:
    """The registered algorithm names, in registration order."""
    return tuple(_REGISTRY)


register("grpo")
register("prompt_gdro", curriculum=PromptGDRO)
register("rollout_gdro", curriculum=RolloutGDRO)
register("ppo", learner=PPO)
register("dapo", curriculum=DynamicSampling)
register("online_filter", curriculum=OnlineDifficultyFilter)
register("learnability", curriculum=LearnabilitySampling)
register("greso", curriculum=GRESO)

__all__ = [
    "PPO",
    "Algorithm",
    "Curriculum",
    "CurriculumState",
    "DynamicSampling",
    "GRESO",
    "LearnabilitySampling",
    "OnlineDifficultyFilter",
    "Learner",
    "PPOBatch",
    "PPOState",
    "Placement",
    "PromptGDRO",
    "RolloutGDRO",
    "StepOutcome",
    "Visit",
    "get",
    "names",
    "register",
]
