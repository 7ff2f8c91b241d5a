"""The data of a run, built from its config (``config.data``, ``config.eval``).

`load_examples` reads one split (a preset, a custom table, the arithmetic task); `build_pool`
renders and tokenizes the training rows into the `PromptPool` the sampler draws from, with the
held-out sets; `render` is the one home of a prompt's text.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from grpo_jax.data import arithmetic, datasets, load_with_stats, pipeline, templates
from grpo_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True, eq=False)
class PromptPool:
    """The training prompts, indexed by prompt id (positions after filtering).

    Attributes:
      tokens: [N, prompt_len] int32, left-padded; mask: [N, prompt_len] bool.
      prompt_len: Lp, the longest train/eval prompt rounded up to 8 (at most
        ``config.data.max_prompt_tokens``).
      golds: N gold answers (strings, or lists for multi-part answers); levels: N ints (-1 =
        none); examples: N example dicts (``id`` = prompt id).
      eval_sets: held-out set name -> its examples.
      sft_examples: the dataset's separate warm-start pool ([] = warm start on this pool).
      stats: counts of the loading (overlong prompts, skipped rows, ...).
    """

    tokens: np.ndarray
    mask: np.ndarray
    prompt_len: int
    golds: list
    levels: list
    examples: list
    eval_sets: dict
    sft_examples: list
    stats: dict

    @classmethod
    def empty(cls, prompt_len: int) -> PromptPool:
        """No data (compile-only builds): one prompt id, arrays of shape [0, prompt_len]."""
        z = np.zeros((0, prompt_len), np.int32)
        return cls(z, z.astype(bool), prompt_len, [], [], [], {}, [], {})

    @property
    def num_ids(self) -> int:
        """Prompt ids the curriculum tracks (1 for an empty pool)."""
        return max(len(self.examples), 1)


def columns(config) -> datasets.Columns:
    """The column names of a custom table (``config.data.*_column``)."""
    d = config.data
    return datasets.Columns(
        prompt=d.prompt_column,
        answer=d.answer_column,
        level=d.level_column,
        id=d.id_column,
        messages=d.messages_column,
    )


def _is_table_dir(path: str) -> bool:
    return os.path.isdir(os.path.expanduser(path)) or path.startswith("hf:") or "*" in path


def _table_of(config, name: str, split: str, train: bool) -> tuple[str | None, str]:
    """(the table to read or None for the preset's own files, the split to read from it)."""
    d = config.data
    path, eval_path = d.path, d.eval_path
    if name == datasets.CUSTOM:
        if train:
            table = path
        elif eval_path:
            table, split = eval_path, d.split
        elif path and _is_table_dir(path):
            table, split = path, d.eval_split
        else:
            raise ConfigError(
                "config.eval.datasets has 'custom': set config.data.eval_path to your held-out "
                "table (or make config.data.path a directory / hub id with an eval_split)"
            )
        if not table:
            raise ConfigError(
                "config.data.name='custom' needs config.data.path (a JSONL/Parquet file, a "
                "directory, or a hub id 'hf:org/name')"
            )
        return table, split
    if name == d.name and (path or eval_path):
        if train:
            return path or None, split
        if eval_path:
            return eval_path, split
        if path and _is_table_dir(path):
            return path, split
    return None, split


def eval_table(config, name: str) -> tuple[str | None, str]:
    """(the table a held-out set ``name`` of ``config.eval.datasets`` is read from, or None for a
    preset's own files or the generated arithmetic set; the split read from it)."""
    if name == "arithmetic":
        return None, "eval"
    return _table_of(config, name, "test", train=False)


def load_examples(
    config, name: str, split: str, stats: dict | None = None, *, train: bool | None = None
) -> list[dict]:
    """The examples of a split; ``stats`` (if given) gets `datasets.load_with_stats`' counts.

    ``name``: a preset, or ``"custom"`` (``config.data.path`` with ``config.data.*_column``;
    held-out rows from ``config.data.eval_path``, else ``data.path``'s ``data.eval_split``).
    A preset equal to ``config.data.name`` with ``config.data.path`` set reads its layout from
    that table. ``train``: the training split (default: ``split == config.data.split``).

    Raises: ConfigError naming the config field of a missing table or a bad row.
    """
    d = config.data
    if train is None:
        train = split == d.split
    if name == "arithmetic":
        splits = arithmetic.make_splits(arithmetic.ArithmeticConfig(**dict(d.arithmetic)))
        return splits[split if split in ("train", "sft") else "eval"]
    table, split = _table_of(config, name, split, train)
    own = (d.config or None) if name == d.name else None
    try:
        if table is not None:
            examples, counts = datasets.load_table_with_stats(
                table, split, columns=columns(config), name=name, config=own, bad_rows=d.bad_rows
            )
        else:
            examples, counts = load_with_stats(
                name,
                split,
                use_tfds=bool(d.use_tfds),
                tfds_data_dir=d.tfds_data_dir or None,
                source_dir=d.source_dir or None,
                config=own,
                bad_rows=d.bad_rows,
            )
    except ValueError as e:
        if "bad row" not in str(e):
            raise
        raise ConfigError(
            f"{e}; in a run: --config.data.bad_rows=skip drops and counts such rows"
        ) from None
    if stats is not None:
        stats.update(counts)
    return examples


def render(config, tokenizer, problem) -> str:
    """A prompt's text under ``config.data.template`` (with ``data.prompt_suffix``, None = the
    DAPO boxed-answer suffix for a problem string and none for a conversation, and
    ``data.system_prompt`` for the chat template). ``problem``: a string or a conversation's
    turns (`templates.prompt_of`)."""
    d = config.data
    kw = {}
    if d.template != "arithmetic":
        kw["suffix"] = d.prompt_suffix
        if d.system_prompt:
            kw["system"] = d.system_prompt
    return templates.render_prompt(problem, template=d.template, tokenizer=tokenizer, **kw)


def build_pool(config, tokenizer, raw: list[dict], load_stats: dict) -> PromptPool:
    """The training pool from the training rows ``raw`` (`load_examples` of the training
    split, ``load_stats`` its counts), with the held-out sets of ``config.eval.datasets``.

    Prompts over ``config.data.max_prompt_tokens`` are skipped or truncated
    (``data.overlong_prompts``, counted); every prompt is left-padded to the longest train or
    eval prompt rounded up to 8 (prefill, log-prob and update compute scale with it).

    Raises: ConfigError when there is no training row, no training prompt fits the budget, or
    a range that depends on the data does not hold (`check_pool`).
    """
    d, lp = config.data, config.data.max_prompt_tokens
    if d.max_train_examples:
        raw = raw[: d.max_train_examples]
    texts = [render(config, tokenizer, templates.prompt_of(ex)) for ex in raw]
    tokens, mask, kept, over = templates.encode_prompts(
        tokenizer, texts, lp, d.overlong_prompts, return_overlong=True
    )
    stats = {
        "train_examples": len(raw),
        "overlong_prompts": int(over.sum()),
        "overlong_prompts_skipped": int((~kept).sum()),
        "bad_rows_skipped": int(load_stats.get("num_skipped", 0)),
    }
    # ids = positions after filtering (stable for a given dataset and config; the classifier keys on them)
    examples = pipeline.reindex([ex for ex, k in zip(raw, kept) if k])
    if not raw:
        raise ConfigError(
            f"config.data: the training split of {_where(config, d.name, d.split)} has no rows"
            + (
                f" ({stats['bad_rows_skipped']} bad rows skipped)"
                if stats["bad_rows_skipped"]
                else ""
            )
        )
    if not examples:
        raise ConfigError(
            f"config.data.max_prompt_tokens={lp}: every training prompt is longer; raise it"
        )
    tokens, mask = tokens[kept], mask[kept]
    eval_sets = {}
    for name in config.eval.datasets:
        evs = load_examples(config, name, "eval" if name == "arithmetic" else "test", train=False)
        eval_sets[name] = evs[: config.eval.max_examples] if config.eval.max_examples else evs
    longest = int(mask.sum(axis=1).max())
    for evs in eval_sets.values():
        for ex in evs:
            longest = max(
                longest, len(tokenizer.encode(render(config, tokenizer, templates.prompt_of(ex))))
            )
    trimmed = min(lp, -(-longest // 8) * 8)
    stats["prompt_tokens_padded_to"] = trimmed
    has_sft_pool = d.name == "arithmetic" and d.arithmetic.get("num_sft", 0)
    pool = PromptPool(
        tokens=tokens[:, lp - trimmed :],
        mask=mask[:, lp - trimmed :],
        prompt_len=trimmed,
        golds=[ex.get("answers", ex["answer"]) for ex in examples],
        levels=[int(ex.get("level", -1)) for ex in examples],
        examples=examples,
        eval_sets=eval_sets,
        sft_examples=load_examples(config, d.name, "sft") if has_sft_pool else [],
        stats=stats,
    )
    check_pool(config, pool)
    return pool


def _where(config, name: str, split: str, train: bool = True) -> str:
    """A split's source for messages: the table's path, or the preset's name."""
    try:
        table, split = _table_of(config, name, split, train)
    except ConfigError:
        table = None
    return f"{table} (split {split!r})" if table else f"dataset {name!r} (split {split!r})"


def check_pool(config, pool: PromptPool) -> None:
    """The ranges that depend on the data, checked once the pool is built (before the weights
    load and before anything is written): ``rollout.prompts_per_step`` <= the training prompts
    (a step draws P distinct prompts), and every held-out set has a row. ``eval.max_examples``
    is a cap (a set smaller than it is used whole).

    Raises: ConfigError naming the field and both numbers.
    """
    d, P, n = config.data, config.rollout.prompts_per_step, len(pool.examples)
    if n < P:
        s = pool.stats
        dropped = [
            f"{s[k]} {what}"
            for k, what in (
                ("bad_rows_skipped", "bad rows skipped"),
                ("overlong_prompts_skipped", f"over data.max_prompt_tokens={d.max_prompt_tokens}"),
            )
            if s.get(k)
        ]
        if d.max_train_examples and s.get("train_examples") == d.max_train_examples:
            dropped.append(f"data.max_train_examples={d.max_train_examples}")
        raise ConfigError(
            f"config.rollout.prompts_per_step={P} is more than the {n} training prompts of "
            f"{_where(config, d.name, d.split)}"
            + (f" ({', '.join(dropped)})" if dropped else "")
            + f"; a step draws P distinct prompts: set it to at most {n}"
        )
    for name, evs in pool.eval_sets.items():
        if not evs:
            raise ConfigError(
                f"config.eval.datasets: the held-out set {name!r} "
                f"({_where(config, name, 'test', train=False)}) has no rows"
            )
