"""Datasets, prompt pipeline, prompt templates and the synthetic arithmetic task.

Modules: `arithmetic` (task + `CharTokenizer`), `pipeline` (`PromptSource`), `templates`
(`render_prompt`, `DAPO_SUFFIX`), `datasets` (`load`, `load_with_stats`), `builders` (TFDS).
"""

from grpo_jax.data.arithmetic import (
    ArithmeticConfig,
    CharTokenizer,
    answer_is_correct,
    format_prompt,
    make_arithmetic,
    sft_examples,
)
from grpo_jax.data.datasets import load, load_with_stats
from grpo_jax.data.pipeline import PromptSource, reindex
from grpo_jax.data.templates import DAPO_SUFFIX, render_prompt

__all__ = [
    "ArithmeticConfig",
    "CharTokenizer",
    "DAPO_SUFFIX",
    "PromptSource",
    "answer_is_correct",
    "format_prompt",
    "load",
    "load_with_stats",
    "make_arithmetic",
    "reindex",
    "render_prompt",
    "sft_examples",
]
