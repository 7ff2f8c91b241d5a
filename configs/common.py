"""Helpers shared by the experiment configs. Each config file's `get_config(arg)` starts from
`grpo_jax.config_schema.base_config()` (re-exported here as `base_config`), the one home of the
defaults.
"""

import ml_collections

from grpo_jax.config_schema import base_config

__all__ = ["apply_algorithm", "base_config", "paper_gdro", "parse_arg"]


def apply_algorithm(c: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """Sets ``algorithm.name`` (a name registered in `grpo_jax.algorithms`).

    Raises: ValueError listing the registered names.
    """
    from grpo_jax import algorithms

    algorithms.get(name)
    c.algorithm.name = name
    return c


def paper_gdro(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Every GDRO switch at the paper's / released code's value (``mode = "paper"``)."""
    for section in (c.gdro.classifier, c.gdro.prompt, c.gdro.rollout):
        section.mode = "paper"
    return c


def parse_arg(
    arg: str,
    flags: tuple[str, ...],
    default: str = "grpo",
    exclusive: tuple[tuple[str, ...], ...] = (),
) -> tuple[str, set[str]]:
    """Splits a config argument ``"<algorithm>[,flag,...]"`` (the part after ``file.py:``).

    Args:
      exclusive: groups of flags of which at most one may be given (each sets the same fields,
        so a later one would silently override an earlier one).

    Returns: (algorithm name, the set of flags). The algorithm may be omitted (``default``).
    Raises: ValueError naming the unknown part and listing the valid algorithms and flags, or
      naming two flags of one ``exclusive`` group.
    """
    from grpo_jax import algorithms

    parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
    algorithm = default
    if parts and parts[0] in algorithms.names():
        algorithm, parts = parts[0], parts[1:]
    for p in parts:
        if p not in flags:
            raise ValueError(
                f"unknown config argument {p!r}: the first part is an algorithm "
                f"({' | '.join(algorithms.names())}), then any of: {', '.join(flags) or 'none'}"
            )
    for group in exclusive:
        given = [f for f in group if f in parts]
        if len(given) > 1:
            raise ValueError(
                f"config arguments {' and '.join(repr(f) for f in given)} cannot be combined: "
                f"each sets the testbed (give one of {', '.join(group)})"
            )
    return algorithm, set(parts)
