"""Datasets, prompt pipeline, prompt templates and the synthetic arithmetic task.

Modules: `arithmetic` (the task; its tokenizer is `models.tokenizer.CharTokenizer`), `pipeline`
(`PromptSource`), `templates` (`render_prompt`, `DAPO_SUFFIX`), `datasets` (the JSONL layouts),
`builders` (TFDS); `load` / `load_with_stats` read a split through either.
"""

from grpo_jax.data import datasets
from grpo_jax.data.arithmetic import (
    ArithmeticConfig,
    answer_is_correct,
    format_prompt,
    make_arithmetic,
    sft_examples,
)
from grpo_jax.data.pipeline import PromptSource, reindex
from grpo_jax.data.templates import DAPO_SUFFIX, render_prompt

__all__ = [
    "ArithmeticConfig",
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


def load_with_stats(
    name: str, split: str = "test", *, use_tfds: bool = False, tfds_data_dir=None, **kwargs
) -> tuple[list[dict], dict]:
    """A dataset split and its counts: `datasets.load_with_stats` (JSONL), or with ``use_tfds``
    the same examples through the dataset's TFDS builder (array_record files prepared once under
    ``tfds_data_dir``, default ``~/tensorflow_datasets``, then read with ``tfds.data_source``).

    Raises: as `datasets.load_with_stats`.
    """
    if not use_tfds or name == "arithmetic":
        return datasets.load_with_stats(name, split, **kwargs)
    from grpo_jax.data import builders  # imports tensorflow_datasets: only on this path

    kwargs.pop("arithmetic_config", None)
    _, config = datasets._spec(name, split, kwargs.pop("config", None))
    return builders.load_via_tfds(name, split, config=config, data_dir=tfds_data_dir, **kwargs)


def load(name: str, split: str = "test", **kwargs) -> list[dict]:
    """`load_with_stats` without the stats."""
    return load_with_stats(name, split, **kwargs)[0]
