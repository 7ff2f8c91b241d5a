"""Loaders for the math-reasoning datasets and the generated arithmetic task.

Every loader returns example dicts with the project-wide schema::

    {"id": int, "problem": str, "answer": str, "level": int, "dataset": str, ...extras}

``id`` is the example's position in the returned list (stable across runs: files are read in a
fixed order and filters are deterministic), which is what `PromptSource` and the GDRO classifier
key on; ``source_index`` keeps the row's index in the source file(s) (0-based, before filtering).
``level`` is the difficulty label (MATH-500: 1..5; arithmetic: 1..5; otherwise -1).

Datasets (folder under the data directory, files, splits):

================ ================================== ===================================== =========
name             files                              gold answer                           splits
================ ================================== ===================================== =========
gsm8k            gsm8k/{train,test}.jsonl           number after ``####`` (commas removed) train, test
math500          math500/test.jsonl                 ``answer``                            test
dapo_math        dapo_math_17k/dapo_math_17k.       ``answer`` (integer string)           train
                 derived.part{1,2}.jsonl
aime24, aime25   {aime24,aime25}/test.jsonl         ``answer`` (``"025"`` → ``"25"``)     test
amc23            amc23/test.jsonl                   ``answer`` (``27.0`` → ``"27"``)      test
minerva_math     minerva_math/test.jsonl            last ``\\boxed{}`` of ``solution``     test
olympiadbench    olympiadbench/test.jsonl           ``final_answer`` (see below)           test
arithmetic       generated (`make_arithmetic`)       exact integer                         train, test
================ ================================== ===================================== =========

``dapo_math`` configs: ``"full"`` (all 17,917 rows) and ``"en_dedup"`` (default; the paper's
English de-duplicated subset): drop rows whose problem contains a CJK ideograph (U+3400-U+4DBF,
U+4E00-U+9FFF, U+F900-U+FAFF: 3,432 rows), then de-duplicate on the whitespace-normalised
problem (``" ".join(problem.split())``) keeping the first index: **13,987 rows**. The paper's
subset (open-r1 ``en`` / TruthRL) has 14,116 rows because it de-duplicated the templated prompt
text, where problems that differ only in whitespace stay distinct: de-duplicating on the
*stripped* problem gives 14,042 = 14,116 - 74 (the 74 rows README's TruthRL note says become
exact duplicates after stripping); normalising inner whitespace as well merges 55 more.

OlympiadBench: ``final_answer`` is a one-element list of LaTeX. When ``is_multiple_answer`` is
true the string holds several answers (``"$69$,$84$"``, ``"1,3,5"``, ``"$(1,2),(3,4)$"``): it is
split at top-level commas into ``answers`` (list[str], ``$`` removed) and ``answer`` is
``", ".join(answers)``; the reward verifies ``answers`` (all parts required). Otherwise
``answers == [answer]``. ``unit`` (e.g. ``"km/h"``; ``""`` if none) is kept as a field and is
not part of the gold.

Data directory: ``source_dir`` argument, else env ``GRPO_JAX_DATA_DIR``, else
``<repo root>/../shared/data`` when it exists (a checkout next to the shared data). A missing
folder or file raises FileNotFoundError with one line naming the dataset, the path tried and the
setting to change (config ``data.source_dir`` or env ``GRPO_JAX_DATA_DIR``).

Bad rows (invalid JSON, a missing or empty problem or gold answer): ``bad_rows="error"`` raises
ValueError naming the file and the 1-based line; ``bad_rows="skip"`` drops them and counts them
(`load_with_stats` returns the counts).

Your own data (``name="custom"``, `load_table_with_stats`): any JSONL / JSON / Parquet file, a
directory or glob of them, or a Hugging Face dataset id (``"hf:org/name"``, through the
`datasets` package when installed - it is not a dependency), with the columns named in a
`Columns`. A preset name with ``path=`` reads that preset's layout from the given table instead
of the data directory. Bad rows name the file and the 1-based row (line for JSONL).

Reading path: plain JSONL (about 0.1 s for DAPO-17k). `grpo_jax.data.load(..., use_tfds=True)` goes through
the TFDS builders in `grpo_jax.data.builders` (array_record files prepared once into
``tfds_data_dir``, read back with ``tfds.data_source``); both paths return identical examples.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import pathlib
import re
from collections.abc import Callable, Iterator
from typing import Any

from grpo_jax.data.arithmetic import ArithmeticConfig, make_arithmetic
from grpo_jax.rewards.extract import gsm8k_marker, last_boxed, normalize_number, split_top_level

__all__ = [
    "CJK_RE",
    "CUSTOM",
    "Columns",
    "load_table_with_stats",
    "read_table",
    "DATASETS",
    "ENV_VAR",
    "default_source_dir",
    "load",
    "load_with_stats",
    "normalize_ws",
    "read_rows",
    "resolve_source_dir",
]

ENV_VAR = "GRPO_JAX_DATA_DIR"
_SETTING = f"config data.source_dir or env {ENV_VAR}"
CJK_RE = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


def normalize_ws(text: str) -> str:
    """Whitespace-normalised text: runs of whitespace -> one space, ends stripped."""
    return " ".join(text.split())


def default_source_dir() -> pathlib.Path | None:
    """``$GRPO_JAX_DATA_DIR``, else ``<repo root>/../shared/data`` if it exists, else None."""
    env = os.environ.get(ENV_VAR)
    if env:
        return pathlib.Path(env)
    guess = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data"
    return guess if guess.is_dir() else None


def resolve_source_dir(name: str, source_dir: str | os.PathLike | None) -> pathlib.Path:
    """The data directory for dataset `name` (see module docstring); FileNotFoundError if none."""
    path = pathlib.Path(source_dir) if source_dir else default_source_dir()
    if path is None:
        guess = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data"
        raise FileNotFoundError(
            f"dataset {name!r}: no data directory (tried {guess}); set {_SETTING}"
        )
    if not path.is_dir():
        raise FileNotFoundError(
            f"dataset {name!r}: data directory not found: {path}; set {_SETTING}"
        )
    return path


# ------------------------------------------------------------------------------------------------
# Row converters: raw JSON dict -> example fields (without id/dataset), or raise _BadRow.
# ------------------------------------------------------------------------------------------------
class _BadRow(ValueError):
    pass


class _MissingColumn(_BadRow):
    """A row without the column ``key`` (``field``: the ``config.data`` field naming it)."""

    def __init__(self, key: str, field: str = ""):
        super().__init__(f"missing or empty {key!r}")
        self.key, self.field = key, field


def _wrong_column(label: str, source, row, e: _BadRow, rows, known: dict) -> None:
    """Raises ValueError (one line: the file, the column, the row's columns, the field) when
    ``e`` is a column that no row of ``rows`` has: a wrong column name, not a bad row (skipping
    such rows would drop them all). ``known`` caches column -> some row has it."""
    if not isinstance(e, _MissingColumn) or not isinstance(rows, (list, tuple)):
        return
    if e.key not in known:
        known[e.key] = any(isinstance(r, dict) and e.key in r for _, _, r in rows)
    if known[e.key]:
        return
    field = f"config.data.{e.field}={e.key!r}: " if e.field else ""
    raise ValueError(
        f"{field}dataset {label!r}: no row of {source} has a column {e.key!r}; its columns: "
        f"{', '.join(map(repr, row))}"
        + (f" (set config.data.{e.field} to one of them)" if e.field else "")
    )


def _column(row: dict, key: str, field: str):
    """``row[key]``; `_MissingColumn` (naming the ``config.data`` field) when there is none."""
    if key not in row:
        raise _MissingColumn(key, field)
    return row[key]


def _text(row: dict, key: str, field: str = "") -> str:
    if key not in row:
        raise _MissingColumn(key, field)
    v = row.get(key)
    if v is None or (isinstance(v, str) and not v.strip()):
        raise _BadRow(f"missing or empty {key!r}")
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _BadRow(f"non-finite {key!r}")
        v = str(int(v)) if v.is_integer() else repr(v)
    return str(v).strip()


def _int_like(s: str) -> str:
    return str(int(s)) if re.fullmatch(r"[+-]?\d+", s) else s


def _gsm8k(row: dict) -> dict:

    solution = _text(row, "answer")
    gold = gsm8k_marker(solution)
    if gold is None:
        raise _BadRow("no '#### <answer>' in 'answer'")
    return {
        "problem": _text(row, "question"),
        "answer": normalize_number(gold),
        "solution": solution,
        "level": -1,
    }


def _math500(row: dict) -> dict:
    level = row.get("level")
    return {
        "problem": _text(row, "problem"),
        "answer": _text(row, "answer"),
        "solution": row.get("solution") or "",
        "level": int(level) if level is not None else -1,
        "subject": row.get("subject") or "",
        "unique_id": row.get("unique_id") or "",
    }


def _dapo(row: dict) -> dict:
    return {
        "problem": _text(row, "problem"),
        "answer": _int_like(_text(row, "answer")),
        "level": -1,
    }


def _simple(row: dict) -> dict:
    return {
        "problem": _text(row, "problem"),
        "answer": _int_like(_text(row, "answer")),
        "level": -1,
    }


def _minerva(row: dict) -> dict:

    solution = _text(row, "solution")
    gold = last_boxed(solution)
    if gold is None:
        raise _BadRow("no \\boxed{} answer in 'solution'")
    return {
        "problem": _text(row, "problem"),
        "answer": gold,
        "solution": solution,
        "level": -1,
        "type": row.get("type") or "",
    }


def _strip_dollars(s: str) -> str:
    return s.replace("$", "").strip()


def split_multiple_answer(text: str) -> list[str]:
    """Split an OlympiadBench multi-answer string at top-level commas (``$`` removed)."""

    return [p for p in (_strip_dollars(x) for x in split_top_level(_strip_dollars(text))) if p]


def _olympiad(row: dict) -> dict:
    final = row.get("final_answer")
    if isinstance(final, str):
        final = [final]
    if not final or not all(isinstance(x, str) and x.strip() for x in final):
        raise _BadRow("missing or empty 'final_answer'")
    if row.get("is_multiple_answer"):
        answers = [p for x in final for p in split_multiple_answer(x)]
    else:
        answers = [_strip_dollars(x) for x in final]
    answers = [a for a in answers if a]
    if not answers:
        raise _BadRow("empty 'final_answer'")
    problem = _text(row, "question")
    if row.get("context"):
        problem = f"{str(row['context']).strip()}\n\n{problem}"
    return {
        "problem": problem,
        "answer": ", ".join(answers),
        "answers": answers,
        "level": -1,
        "is_multiple_answer": bool(row.get("is_multiple_answer")),
        "unit": _strip_dollars(row.get("unit") or ""),
        "answer_type": row.get("answer_type") or "",
        "solution": "\n".join(row.get("solution") or [])
        if isinstance(row.get("solution"), list)
        else (row.get("solution") or ""),
    }


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """Where a dataset lives and how its rows convert."""

    name: str
    folder: str
    splits: dict[str, tuple[str, ...]]
    convert: Callable[[dict], dict]
    configs: tuple[str, ...] = ()
    default_config: str | None = None


DATASETS: dict[str, DatasetSpec] = {
    s.name: s
    for s in [
        DatasetSpec("gsm8k", "gsm8k", {"train": ("train.jsonl",), "test": ("test.jsonl",)}, _gsm8k),
        DatasetSpec("math500", "math500", {"test": ("test.jsonl",)}, _math500),
        DatasetSpec(
            "dapo_math",
            "dapo_math_17k",
            {"train": ("dapo_math_17k.derived.part1.jsonl", "dapo_math_17k.derived.part2.jsonl")},
            _dapo,
            configs=("en_dedup", "full"),
            default_config="en_dedup",
        ),
        DatasetSpec("aime24", "aime24", {"test": ("test.jsonl",)}, _simple),
        DatasetSpec("aime25", "aime25", {"test": ("test.jsonl",)}, _simple),
        DatasetSpec("amc23", "amc23", {"test": ("test.jsonl",)}, _simple),
        DatasetSpec("minerva_math", "minerva_math", {"test": ("test.jsonl",)}, _minerva),
        DatasetSpec("olympiadbench", "olympiadbench", {"test": ("test.jsonl",)}, _olympiad),
    ]
}
NAMES = tuple(DATASETS) + ("arithmetic",)


CUSTOM = "custom"  # the dataset name of a user table (`load_table_with_stats`)
# the example's own fields: a user column of one of these names is not copied into it ("messages"
# holds the prompt turns of a conversational row, so a raw column of that name is never taken for
# one unless ``Columns.messages`` names it)
_CORE = ("id", "dataset", "source_index", "problem", "answer", "answers", "level", "messages")


@dataclasses.dataclass(frozen=True)
class Columns:
    """Which columns of a user table hold what (``config.data.*_column``).

    prompt: the problem text; answer: the gold answer ("" = none: the reward reads row fields);
    level: optional integer difficulty; id: optional unique row id (kept as ``source_id``);
    messages: optional column of conversational rows (a list of ``{"role", "content"}`` turns,
    TRL's conversational format), used instead of ``prompt`` (see `conversation`).
    Every other column is kept in the example under its own name (a reward function gets them).
    """

    prompt: str = "problem"
    answer: str = "answer"
    level: str = ""
    id: str = ""
    messages: str = ""


CHAT_ROLES = ("system", "user", "assistant")


def conversation(value, key: str) -> tuple[list[dict], str | None]:
    """A messages cell -> (the prompt's turns, the final assistant turn's content or None).

    The turns are dicts with ``role`` in `CHAT_ROLES` and a non-empty string ``content``; a
    final assistant turn is the reference completion: it is cut from the prompt (and may serve
    as the gold answer). The prompt must then end with a user turn. Raises `_BadRow` (naming
    the column and the turn) otherwise."""
    if not isinstance(value, (list, tuple)) or not value:
        raise _BadRow(f"{key!r} is not a non-empty list of turns")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or turn.get("role") not in CHAT_ROLES:
            raise _BadRow(f"{key!r} turn {i} has no role in {CHAT_ROLES}: {turn!r:.80}")
        content = turn.get("content")
        if not isinstance(content, str) or not content.strip():
            raise _BadRow(f"{key!r} turn {i} ({turn['role']}) has no text content")
        turns.append({"role": turn["role"], "content": content})
    reference = turns.pop()["content"] if turns[-1]["role"] == "assistant" else None
    if not turns or turns[-1]["role"] != "user":
        raise _BadRow(
            f"{key!r}: the prompt (before a final assistant turn) must end with a user turn"
        )
    return turns, reference


def _gold(value, key: str):
    """A gold answer cell: str / number -> str; list of str -> (answer, answers); other JSON
    values (dicts, e.g. test cases for your own reward) are kept as they are."""
    if isinstance(value, (list, tuple)):
        parts = [_text({key: v}, key) for v in value]
        if not parts:
            raise _BadRow(f"empty {key!r}")
        return ", ".join(parts), parts
    if isinstance(value, dict):
        if not value:
            raise _BadRow(f"empty {key!r}")
        return value, None
    return _text({key: value}, key), None


def column_converter(columns: Columns) -> Callable[[dict], dict]:
    """A row converter for a user table (see `Columns`)."""

    def convert(row: dict) -> dict:
        ex = {k: v for k, v in row.items() if k not in _CORE}
        reference = None
        if columns.messages:
            value = _column(row, columns.messages, "messages_column")
            ex["messages"], reference = conversation(value, columns.messages)
            ex["problem"] = ex["messages"][-1]["content"].strip()  # the last user turn
        else:
            ex["problem"] = _text(row, columns.prompt, "prompt_column")
        if columns.messages and reference is not None and row.get(columns.answer) is None:
            ex["answer"] = reference.strip()  # the gold: the conversation's final assistant turn
        elif columns.answer:
            if _column(row, columns.answer, "answer_column") is None:
                raise _BadRow(f"missing or empty {columns.answer!r}")
            ex["answer"], answers = _gold(row[columns.answer], columns.answer)
            if answers is not None:
                ex["answers"] = answers
        else:
            ex["answer"] = ""
        ex["level"] = -1
        if columns.level:
            v = _column(row, columns.level, "level_column")
            try:
                if isinstance(v, bool) or v is None or float(v) != int(float(v)):
                    raise ValueError
                ex["level"] = int(float(v))
            except (TypeError, ValueError):
                raise _BadRow(f"{columns.level!r} is not an integer level: {v!r}") from None
        if columns.id:
            if _column(row, columns.id, "id_column") is None:
                raise _BadRow(f"missing {columns.id!r}")
            ex["source_id"] = row[columns.id]
        return ex

    return convert


_TABLE_SUFFIXES = (".jsonl", ".json", ".parquet")
_HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def table_files(path: str, split: str) -> list[pathlib.Path]:
    """The local files a table reads for ``split`` (see `read_table`); FileNotFoundError (one
    line) when nothing matches."""
    p = pathlib.Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(
            f
            for f in p.rglob("*")
            if f.is_file() and f.suffix in _TABLE_SUFFIXES and f.name.startswith(split)
        )
        if not files:
            raise FileNotFoundError(
                f"table {path}: no {'/'.join(_TABLE_SUFFIXES)} file whose name starts with "
                f"{split!r} in the directory"
            )
        return files
    if any(c in path for c in "*?["):
        files = sorted(pathlib.Path(f) for f in glob.glob(os.path.expanduser(path)))
        if not files:
            raise FileNotFoundError(f"table {path}: the pattern matches no file")
        return files
    raise FileNotFoundError(f"table {path}: no such file or directory")


def _hf_rows(dataset_id: str, split: str, hf_config: str | None):
    try:
        import datasets as hf_datasets  # optional: not a dependency of grpo_jax
    except ImportError:
        raise FileNotFoundError(
            f"table {dataset_id!r}: not a local file, and loading a Hugging Face dataset by id "
            "needs the `datasets` package (pip install datasets)"
        ) from None
    name = dataset_id.removeprefix("hf:")
    try:
        ds = hf_datasets.load_dataset(name, hf_config or None, split=split)
    except Exception as e:  # offline and not cached, unknown id or split: one line
        raise FileNotFoundError(
            f"Hugging Face dataset {name!r} (split {split!r}): {' '.join(str(e).split())[:300]}"
        ) from None
    label = f"hf:{name}[{split}]"
    for i, row in enumerate(ds, start=1):
        yield label, i, dict(row)


def read_table(
    path: str, *, split: str = "train", hf_config: str | None = None
) -> Iterator[tuple[str, int, Any]]:
    """Yield ``(source, 1-based row, row dict or the raw line if invalid)`` of a user table.

    ``path``: a ``.jsonl`` (one JSON object per line; ``.json`` may also hold one array of
    objects) or ``.parquet`` file; a directory (its files whose name starts with ``split``, e.g.
    ``train.jsonl``, ``train-00000-of-00002.parquet``, in name order); a glob; or a Hugging
    Face dataset id (``"hf:org/name"``, or ``"org/name"`` when no such local path exists),
    loaded with the `datasets` package (local cache offline, downloaded online).
    Raises FileNotFoundError (one line) when nothing matches.
    """
    path = str(path)
    local = not path.startswith("hf:") and (
        os.path.exists(os.path.expanduser(path))
        or any(c in path for c in "*?[")
        or not _HUB_ID_RE.fullmatch(path)
    )
    if not local:
        yield from _hf_rows(path, split, hf_config)
        return
    for f in table_files(path, split):
        if f.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise FileNotFoundError(
                    f"table {f}: reading Parquet needs pyarrow (pip install pyarrow)"
                ) from None
            pf = pq.ParquetFile(f)
            i = 0
            for batch in pf.iter_batches(batch_size=4096):
                for row in batch.to_pylist():
                    i += 1
                    yield str(f), i, row
            continue
        with open(f, encoding="utf-8") as fh:
            if f.suffix == ".json":
                head = fh.read(4096).lstrip()
                fh.seek(0)
                if head.startswith("["):
                    try:
                        rows = json.load(fh)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"table {f}: invalid JSON: {e}") from None
                    for i, row in enumerate(rows, start=1):
                        yield str(f), i, row
                    continue
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    yield str(f), lineno, json.loads(line)
                except json.JSONDecodeError:
                    yield str(f), lineno, line


def _convert_table(label: str, convert, rows, *, bad_rows: str, unique_key: str = ""):
    if bad_rows not in ("error", "skip"):
        raise ValueError(f"bad_rows must be 'error' or 'skip', got {bad_rows!r}")
    out, skipped, seen, known = [], 0, {}, {}
    for index, (source, rownum, row) in enumerate(rows):
        try:
            if not isinstance(row, dict):
                raise _BadRow("not a JSON object")
            ex = convert(row)
            if unique_key:
                key = json.dumps(ex["source_id"], sort_keys=True, default=str)
                if key in seen:
                    raise _BadRow(
                        f"duplicate {unique_key!r} {ex['source_id']!r} (first at row {seen[key]})"
                    )
                seen[key] = rownum
        except _BadRow as e:
            _wrong_column(label, source, row, e, rows, known)
            message = (
                f"dataset {label!r}: bad row at {source}:{rownum}: {e} "
                "(fix the file or load with bad_rows='skip')"
            )
            if bad_rows == "error":
                raise ValueError(message) from None
            skipped += 1
            continue
        ex["source_index"] = index
        out.append(ex)
    return out, skipped


def _check_not_empty(path: str, split: str, rows: list) -> None:
    """ValueError naming the file(s) when a table has no rows (an empty file)."""
    if rows:
        return
    try:
        where = ", ".join(str(f) for f in table_files(path, split))
    except FileNotFoundError:
        where = str(path)
    raise ValueError(f"table {where}: the file is empty (no rows in split {split!r})")


def load_table_with_stats(
    path: str,
    split: str = "train",
    *,
    columns: Columns | None = None,
    name: str = CUSTOM,
    config: str | None = None,
    bad_rows: str = "error",
) -> tuple[list[dict], dict]:
    """Load a table (see `read_table`) as examples; also return counts (as `load_with_stats`).

    With ``name=CUSTOM`` the rows convert by ``columns``; with a preset name they convert by
    that preset's layout and filters (e.g. ``name="gsm8k"`` reads GSM8K's question/answer
    columns from your own copy). ``config``: the preset's config, or the hub dataset's config.
    Raises: ValueError (a bad row with ``bad_rows="error"``, naming file and row),
    FileNotFoundError (nothing at ``path``, one line).
    """
    if name == CUSTOM:
        columns = columns or Columns()
        rows = list(read_table(path, split=split, hf_config=config))
        _check_not_empty(path, split, rows)
        examples, skipped = _convert_table(
            name, column_converter(columns), rows, bad_rows=bad_rows, unique_key=columns.id
        )
        counts = {"num_dropped_cjk": 0, "num_dropped_duplicates": 0}
    else:
        spec, config = _spec(name, split, config)
        rows = list(read_table(path, split=split))
        _check_not_empty(path, split, rows)
        examples, skipped = _convert_table(name, spec.convert, rows, bad_rows=bad_rows)
        examples, counts = filter_examples(name, config, examples)
    finalize(name, examples)
    stats = {"num_rows": len(rows), "num_skipped": skipped, **counts, "num_examples": len(examples)}
    return examples, stats


def _spec(name: str, split: str, config: str | None) -> tuple[DatasetSpec, str | None]:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(NAMES)}")
    spec = DATASETS[name]
    if split not in spec.splits:
        raise ValueError(f"dataset {name!r} has no split {split!r}; splits: {tuple(spec.splits)}")
    if spec.configs:
        config = config or spec.default_config
        if config not in spec.configs:
            raise ValueError(
                f"dataset {name!r}: unknown config {config!r}; configs: {spec.configs}"
            )
    elif config:
        raise ValueError(f"dataset {name!r} has no configs (got {config!r})")
    return spec, config


def source_files(name: str, split: str, source_dir=None) -> list[pathlib.Path]:
    """The JSONL files of a split, checked to exist (FileNotFoundError: one line, see module)."""
    spec, _ = _spec(name, split, None)
    root = resolve_source_dir(name, source_dir)
    files = [root / spec.folder / f for f in spec.splits[split]]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"dataset {name!r}: file not found: {f}; set {_SETTING}")
    return files


def read_rows(name: str, split: str, source_dir=None) -> Iterator[tuple[pathlib.Path, int, Any]]:
    """Yield ``(file, 1-based line, parsed JSON or the raw line if invalid)`` for a split."""
    for path in source_files(name, split, source_dir):
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    yield path, lineno, json.loads(line)
                except json.JSONDecodeError:
                    yield path, lineno, line


def convert_rows(name: str, rows, *, bad_rows: str = "error", errors: list | None = None):
    """Convert raw rows to examples (no filtering / ids). Returns ``(examples, num_skipped)``.

    Each example gets ``source_index`` (its 0-based position among the raw rows of the split).
    With ``bad_rows="skip"`` the error message of each skipped row is appended to `errors`.
    """
    if bad_rows not in ("error", "skip"):
        raise ValueError(f"bad_rows must be 'error' or 'skip', got {bad_rows!r}")
    spec = DATASETS[name]
    out, skipped, known = [], 0, {}
    for index, (path, lineno, row) in enumerate(rows):
        try:
            if not isinstance(row, dict):
                raise _BadRow("not a JSON object")
            ex = spec.convert(row)
        except _BadRow as e:
            _wrong_column(name, path, row, e, rows, known)
            message = (
                f"dataset {name!r}: bad row at {path}:{lineno}: {e} "
                "(fix the file or load with bad_rows='skip')"
            )
            if bad_rows == "error":
                raise ValueError(message) from None
            if errors is not None:
                errors.append(message)
            skipped += 1
            continue
        ex["source_index"] = index
        out.append(ex)
    return out, skipped


def filter_examples(name: str, config: str | None, examples: list[dict]) -> tuple[list[dict], dict]:
    """Apply a config's filters (DAPO ``en_dedup``); returns ``(examples, counts)``."""
    counts = {"num_dropped_cjk": 0, "num_dropped_duplicates": 0}
    if name == "dapo_math" and config == "en_dedup":
        seen: set[str] = set()
        kept = []
        for ex in examples:
            if CJK_RE.search(ex["problem"]):
                counts["num_dropped_cjk"] += 1
                continue
            key = normalize_ws(ex["problem"])
            if key in seen:
                counts["num_dropped_duplicates"] += 1
                continue
            seen.add(key)
            kept.append(ex)
        examples = kept
    return examples, counts


def finalize(name: str, examples: list[dict]) -> list[dict]:
    """Assign ``id`` = position and ``dataset`` = name (in place; returns the list)."""
    for i, ex in enumerate(examples):
        ex["id"] = i
        ex["dataset"] = name
    return examples


def load_with_stats(
    name: str,
    split: str = "test",
    *,
    source_dir: str | os.PathLike | None = None,
    config: str | None = None,
    bad_rows: str = "error",
    arithmetic_config=None,
) -> tuple[list[dict], dict]:
    """Load a dataset split; also return counts.

    Args:
      name: one of `NAMES` (``gsm8k``, ``math500``, ``dapo_math``, ``aime24``, ``aime25``,
        ``amc23``, ``minerva_math``, ``olympiadbench``, ``arithmetic``).
      split: ``"train"`` / ``"test"`` (see the table; ``arithmetic`` also accepts ``"eval"``).
      source_dir: data directory (default: see module docstring).
      config: dataset config (``dapo_math``: ``"en_dedup"`` default, or ``"full"``).
      bad_rows: ``"error"`` or ``"skip"``.
      arithmetic_config: `ArithmeticConfig` for ``name="arithmetic"`` (default config).

    Returns:
      ``(examples, stats)`` with stats ``{"num_rows": raw rows read, "num_skipped": bad rows
      skipped, "num_dropped_cjk", "num_dropped_duplicates", "num_examples"}``.

    Raises:
      ValueError: unknown name/split/config, a bad row with ``bad_rows="error"``.
      FileNotFoundError: data directory or file missing (one line naming dataset, path, setting).
    """
    if name == "arithmetic":
        if split not in ("train", "test", "eval"):
            raise ValueError(f"dataset 'arithmetic' has splits train/test (eval), got {split!r}")
        train, evals = make_arithmetic(arithmetic_config or ArithmeticConfig())
        examples = train if split == "train" else evals
        return examples, {
            "num_rows": len(examples),
            "num_skipped": 0,
            "num_dropped_cjk": 0,
            "num_dropped_duplicates": 0,
            "num_examples": len(examples),
        }
    spec, config = _spec(name, split, config)
    rows = list(read_rows(name, split, source_dir))
    if not rows:
        files = ", ".join(str(f) for f in source_files(name, split, source_dir))
        raise ValueError(f"dataset {name!r}: {files}: the file is empty (no rows)")
    examples, skipped = convert_rows(name, rows, bad_rows=bad_rows)
    examples, counts = filter_examples(name, config, examples)
    finalize(name, examples)
    stats = {"num_rows": len(rows), "num_skipped": skipped, **counts, "num_examples": len(examples)}
    return examples, stats


def load(name: str, split: str = "test", **kwargs) -> list[dict]:
    """`load_with_stats` without the stats (see there for arguments and errors)."""
    return load_with_stats(name, split, **kwargs)[0]
