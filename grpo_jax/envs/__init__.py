"""Multi-turn environments (issue 44): the policy's turn is sampled up to a stop (end of text, a
tool-call close token, or its budget), the environment answers with the next observation (a
tool's output, feedback) and whether the episode ended, and the episode's tokens become one
row whose loss mask covers the policy's own tokens only (`episodes.run_episodes`).

An environment is one class and one registration line::

    @envs.register_environment("calculator")
    class Calculator(envs.Environment):
        stop_strings = (")",)
        def step(self, state, turn_text): ...

`grpo_jax.envs.tools` holds the built-in ones (a calculator, the sandboxed Python tool).
"""

from __future__ import annotations

from grpo_jax.envs import tools  # noqa: F401  (registers the built-in environments)
from grpo_jax.envs.base import _ENVIRONMENTS, Environment, EnvStep, register_environment
from grpo_jax.errors import ConfigError
from grpo_jax.rewards.custom import resolve_callable


def make_environment(spec: str, **kwargs) -> Environment:
    """An environment by registered name or ``module:Class``.

    Raises:
      errors.ConfigError: an unknown name or an unimportable class (one line).
    """
    if spec in _ENVIRONMENTS:
        return _ENVIRONMENTS[spec](**kwargs)
    if ":" in spec:
        return resolve_callable(spec, "environment")(**kwargs)
    raise ConfigError(
        f"env.name={spec!r}: not a registered environment ({', '.join(sorted(_ENVIRONMENTS))}) "
        "nor module:Class"
    )


__all__ = ["EnvStep", "Environment", "make_environment", "register_environment"]
