"""The project-wide exceptions: a leaf module (it imports nothing from grpo_jax), so every
layer can raise them without importing the layers above it."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid or incompatible configuration. The message is one line and names the field."""
