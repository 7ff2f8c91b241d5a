"""Tests for grpo_jax.data.datasets (JSONL loaders) and grpo_jax.data.builders (TFDS)."""

import json
import re

import pytest

import grpo_jax.data
from grpo_jax.data import datasets

SHARED = datasets.default_source_dir()
needs_data = pytest.mark.skipif(SHARED is None, reason="shared data directory not found")

EXPECTED_ROWS = [
    ("gsm8k", "train", None, 7473),
    ("gsm8k", "test", None, 1319),
    ("math500", "test", None, 500),
    ("dapo_math", "train", "full", 17917),
    ("aime24", "test", None, 30),
    ("aime25", "test", None, 30),
    ("amc23", "test", None, 40),
    ("minerva_math", "test", None, 272),
    ("olympiadbench", "test", None, 675),
]


@needs_data
@pytest.mark.parametrize("name,split,config,rows", EXPECTED_ROWS)
def test_row_counts_and_schema(name, split, config, rows):
    examples, stats = datasets.load_with_stats(name, split, config=config)
    assert len(examples) == rows == stats["num_rows"] and stats["num_skipped"] == 0
    for i, ex in enumerate(examples):
        assert ex["id"] == i and ex["dataset"] == name and ex["source_index"] == i
        assert isinstance(ex["problem"], str) and ex["problem"].strip()
        assert isinstance(ex["answer"], str) and ex["answer"].strip()
        assert isinstance(ex["level"], int)


@needs_data
def test_gold_fields():
    gsm = datasets.load("gsm8k", "test")
    assert gsm[0]["answer"] == "18" and gsm[0]["solution"].endswith("#### 18")
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", ex["answer"]) for ex in gsm)  # commas removed
    math = datasets.load("math500")
    assert sorted({ex["level"] for ex in math}) == [1, 2, 3, 4, 5]
    assert datasets.load("aime24")[0]["answer"] == "204"
    assert all(
        not ex["answer"].startswith("0") or ex["answer"] == "0" for ex in datasets.load("aime24")
    )
    assert datasets.load("amc23")[0]["answer"] == "27"
    assert datasets.load("minerva_math")[0]["answer"] == "1.6"
    olympiad = datasets.load("olympiadbench")
    multi = [ex for ex in olympiad if ex["is_multiple_answer"]]
    assert len(multi) == 94
    by_raw = {ex["answer"]: ex["answers"] for ex in multi}
    assert by_raw["69, 84"] == ["69", "84"]
    assert by_raw["1, 3, 5"] == ["1", "3", "5"]
    assert by_raw["(1,8,19), (2,7,13), (4,5,7)"] == ["(1,8,19)", "(2,7,13)", "(4,5,7)"]
    assert all(ex["answers"] == [ex["answer"]] for ex in olympiad if not ex["is_multiple_answer"])
    assert sorted(ex["unit"] for ex in olympiad if ex["unit"])[:2] == ["%", "^{\\circ}"]


@needs_data
def test_dapo_en_dedup_count():
    examples, stats = datasets.load_with_stats("dapo_math", "train", config="en_dedup")
    print(
        f"\nDAPO-Math-17k en_dedup: {len(examples)} rows (dropped {stats['num_dropped_cjk']} CJK, "
        f"{stats['num_dropped_duplicates']} duplicates; paper's subset: 14,116)"
    )
    assert len(examples) == 13987
    assert stats["num_dropped_cjk"] == 3432 and stats["num_dropped_duplicates"] == 498
    assert datasets.load("dapo_math", "train") == examples  # en_dedup is the default config
    # Independent recomputation: no Han ideograph, unique normalised problems, first index kept.
    full = datasets.load("dapo_math", "train", config="full")
    seen, kept = set(), []
    for ex in full:
        if any("\u4e00" <= ch <= "\u9fff" for ch in ex["problem"]):
            continue
        key = re.sub(r"\s+", " ", ex["problem"]).strip()
        if key not in seen:
            seen.add(key)
            kept.append(ex["source_index"])
    assert [ex["source_index"] for ex in examples] == kept
    assert [ex["id"] for ex in examples] == list(range(13987))


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")


@pytest.fixture
def toy_dir(tmp_path):
    _write(
        tmp_path / "gsm8k" / "test.jsonl",
        [
            {"question": "Q1?", "answer": "work\n#### 1,000"},
            {"question": "Q2?", "answer": "work\n#### 2"},
            {"question": "", "answer": "#### 3"},  # line 3: empty problem
            "{not json",  # line 4: invalid JSON
            {"question": "Q5?", "answer": "no marker"},  # line 5: no gold
            {"question": "Q6?", "answer": "#### 6"},
        ],
    )
    _write(tmp_path / "gsm8k" / "train.jsonl", [{"question": "T?", "answer": "#### 1"}])
    _write(
        tmp_path / "dapo_math_17k" / "dapo_math_17k.derived.part1.jsonl",
        [
            {"problem": "Find x.", "answer": "1", "index": 0},
            {"problem": "求 x 的值。", "answer": "2", "index": 1},
            {"problem": "Find  x.\n", "answer": "1", "index": 2},  # whitespace duplicate of 0
        ],
    )
    _write(
        tmp_path / "dapo_math_17k" / "dapo_math_17k.derived.part2.jsonl",
        [
            {"problem": "Find y.", "answer": "007", "index": 3},
            {"problem": "Find x. ", "answer": "1", "index": 4},  # duplicate of 0
        ],
    )
    return tmp_path


def test_bad_rows_error_names_file_and_line(toy_dir):
    with pytest.raises(ValueError) as info:
        datasets.load("gsm8k", "test", source_dir=toy_dir)
    msg = str(info.value)
    assert (
        f"{toy_dir / 'gsm8k' / 'test.jsonl'}:3" in msg and "'question'" in msg and "\n" not in msg
    )
    examples, stats = datasets.load_with_stats("gsm8k", "test", source_dir=toy_dir, bad_rows="skip")
    assert stats["num_skipped"] == 3 and stats["num_rows"] == 6
    assert [ex["answer"] for ex in examples] == ["1000", "2", "6"]
    assert [ex["id"] for ex in examples] == [0, 1, 2]
    assert [ex["source_index"] for ex in examples] == [0, 1, 5]


def test_missing_dataset_dir_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError) as info:
        datasets.load("math500", source_dir=tmp_path)
    msg = str(info.value)
    assert (
        "\n" not in msg and "'math500'" in msg and str(tmp_path / "math500" / "test.jsonl") in msg
    )
    assert "data.source_dir" in msg and "GRPO_JAX_DATA_DIR" in msg
    with pytest.raises(FileNotFoundError, match="data directory not found"):
        datasets.load("aime24", source_dir=tmp_path / "nope")
    monkeypatch.setenv(datasets.ENV_VAR, str(tmp_path / "elsewhere"))
    with pytest.raises(FileNotFoundError, match="elsewhere.*GRPO_JAX_DATA_DIR"):
        datasets.load("aime24")


def test_env_var_and_unknown_names(toy_dir, monkeypatch):
    monkeypatch.setenv(datasets.ENV_VAR, str(toy_dir))
    assert len(datasets.load("gsm8k", "train")) == 1
    with pytest.raises(ValueError, match="unknown dataset"):
        datasets.load("mnist")
    with pytest.raises(ValueError, match="no split"):
        datasets.load("math500", "train")
    with pytest.raises(ValueError, match="unknown config"):
        datasets.load("dapo_math", "train", config="zh")
    with pytest.raises(ValueError, match="bad_rows"):
        datasets.load("gsm8k", "train", bad_rows="ignore")


def test_en_dedup_filter_on_toy(toy_dir):
    ex, stats = datasets.load_with_stats("dapo_math", "train", source_dir=toy_dir)
    assert [e["problem"] for e in ex] == ["Find x.", "Find y."]
    assert [e["source_index"] for e in ex] == [0, 3] and ex[1]["answer"] == "7"
    assert stats["num_dropped_cjk"] == 1 and stats["num_dropped_duplicates"] == 2
    assert len(datasets.load("dapo_math", "train", source_dir=toy_dir, config="full")) == 5


def test_arithmetic_through_load():
    from grpo_jax.data.arithmetic import ArithmeticConfig

    cfg = ArithmeticConfig(num_train=20, num_eval=5)
    assert len(datasets.load("arithmetic", "train", arithmetic_config=cfg)) == 20
    assert len(datasets.load("arithmetic", "test", arithmetic_config=cfg)) == 5


# -------------------------------------------------------------------------------------------
# TFDS builders (array_record, no TensorFlow).
# -------------------------------------------------------------------------------------------
def test_no_tensorflow_needed():
    import sys

    from grpo_jax.data import builders  # noqa: F401 -- the import is the test

    assert "tensorflow" not in sys.modules


def test_tfds_matches_jsonl_on_toy(toy_dir, tmp_path):
    cache = tmp_path / "tfds"
    for config in ("en_dedup", "full"):
        direct = datasets.load_with_stats("dapo_math", "train", source_dir=toy_dir, config=config)
        via = grpo_jax.data.load_with_stats(
            "dapo_math",
            "train",
            source_dir=toy_dir,
            config=config,
            use_tfds=True,
            tfds_data_dir=cache,
        )
        assert via == direct
    # Bad rows: the same error (file and line) and the same skip counts as the JSONL path.
    with pytest.raises(ValueError, match=r"test\.jsonl:3"):
        grpo_jax.data.load("gsm8k", "test", source_dir=toy_dir, use_tfds=True, tfds_data_dir=cache)
    assert grpo_jax.data.load_with_stats(
        "gsm8k", "test", source_dir=toy_dir, bad_rows="skip", use_tfds=True, tfds_data_dir=cache
    ) == datasets.load_with_stats("gsm8k", "test", source_dir=toy_dir, bad_rows="skip")


def test_tfds_builder_and_data_source_directly(toy_dir, tmp_path):
    import tensorflow_datasets as tfds

    from grpo_jax.data.builders import GrpoDapoMath

    builder = GrpoDapoMath(config="en_dedup", data_dir=str(tmp_path / "d"))
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=str(toy_dir))
    )
    source = tfds.data_source(
        "grpo_dapo_math/en_dedup", split="train", data_dir=str(tmp_path / "d"), download=False
    )
    assert len(source) == 2
    problems = sorted(rec["problem"].decode() for rec in source.__getitems__([0, 1]))
    assert problems == ["Find x.", "Find y."]
    assert builder.info.metadata["train/num_dropped_cjk"] == 1


@needs_data
def test_tfds_matches_jsonl_real_small(tmp_path):
    for name in ("aime24", "olympiadbench"):
        assert grpo_jax.data.load(name, use_tfds=True, tfds_data_dir=tmp_path) == datasets.load(
            name
        )
