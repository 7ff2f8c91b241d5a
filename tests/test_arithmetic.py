"""Tests for grpo_jax.data.arithmetic: problems, answers, splits, level mixes, CharTokenizer."""

import collections
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax.data.arithmetic import (
    LEVELS,
    ArithmeticConfig,
    CharTokenizer,
    answer_is_correct,
    answer_reward,
    evaluate_expression,
    format_prompt,
    level_counts,
    make_arithmetic,
    sft_examples,
)

LEVEL_PATTERNS = {
    1: r"\d{1,2}\+\d",
    2: r"[1-9]\d\+[1-9]\d",
    3: r"[1-9]\d\+[1-9]\d-[1-9]\d",
    4: r"\d{1,2}\*\d",
}


def test_evaluate_expression_hand_values():
    assert evaluate_expression("3+4") == 7
    assert evaluate_expression("12+7") == 19
    assert evaluate_expression("45+67-89") == 23
    assert evaluate_expression("37*6") == 222
    assert evaluate_expression("12+34*5-67") == 12 + 170 - 67
    assert evaluate_expression("10-99*9-99") == -980
    assert evaluate_expression("99*9+99+99") == 1089
    assert evaluate_expression("20-3-4") == 13  # left-associative
    for bad in ["", "1+", "-1+2", "1/2", "1 + 2", "(1+2)", "a+b"]:
        with pytest.raises(ValueError):
            evaluate_expression(bad)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 999), min_size=1, max_size=5),
    st.lists(st.sampled_from("+-*"), min_size=4, max_size=4),
)
def test_evaluate_expression_matches_python(nums, ops):
    text = str(nums[0]) + "".join(f"{o}{n}" for o, n in zip(ops, nums[1:]))
    assert evaluate_expression(text) == eval(text)


def test_make_arithmetic_shapes_and_answers():
    cfg = ArithmeticConfig(num_train=500, num_eval=100, seed=1)
    train, evals = make_arithmetic(cfg)
    assert len(train) == 500 and len(evals) == 100
    for split in (train, evals):
        assert [ex["id"] for ex in split] == list(range(len(split)))
        for ex in split:
            assert set(ex) == {"id", "problem", "answer", "level", "dataset"}
            assert ex["dataset"] == "arithmetic"
            assert ex["answer"] == str(eval(ex["problem"]))
            assert len(format_prompt(ex["problem"])) <= 16
            assert len(ex["answer"]) <= 6
            if ex["level"] in LEVEL_PATTERNS:
                assert re.fullmatch(LEVEL_PATTERNS[ex["level"]], ex["problem"]), ex
            else:  # level 5: three operators, exactly one "*", its right operand one digit
                ops = re.findall(r"[+\-*]", ex["problem"])
                assert len(ops) == 3 and ops.count("*") == 1
                assert re.search(r"\*\d(?!\d)", ex["problem"])
    assert collections.Counter(ex["level"] for ex in train) == dict.fromkeys(range(1, 6), 100)
    assert collections.Counter(ex["level"] for ex in evals) == dict.fromkeys(range(1, 6), 20)
    assert not {ex["problem"] for ex in train} & {ex["problem"] for ex in evals}


def test_make_arithmetic_seeded():
    a = make_arithmetic(ArithmeticConfig(num_train=50, num_eval=10, seed=0))
    b = make_arithmetic(ArithmeticConfig(num_train=50, num_eval=10, seed=0))
    c = make_arithmetic(ArithmeticConfig(num_train=50, num_eval=10, seed=1))
    assert a == b and a != c


def test_level_weights_and_heavy_tail():
    train, evals = make_arithmetic(ArithmeticConfig(num_train=1000, num_eval=50, heavy_tailed=True))
    counts = collections.Counter(ex["level"] for ex in train)
    w = 1.0 / np.arange(1, 6) ** 2
    expected = level_counts(1000, w / w.sum())
    assert [counts[lv] for lv in range(1, 6)] == expected
    assert expected[0] > 600 and expected[4] < 40 and sum(expected) == 1000
    assert collections.Counter(ex["level"] for ex in evals) == dict.fromkeys(range(1, 6), 10)

    train, _ = make_arithmetic(
        ArithmeticConfig(num_train=90, num_eval=0, levels=(2, 4), level_weights=(2.0, 1.0))
    )
    assert collections.Counter(ex["level"] for ex in train) == {2: 60, 4: 30}
    cfg = ArithmeticConfig(levels=[2, 4], level_weights=[2, 1])  # lists, as from a ConfigDict
    assert cfg.levels == (2, 4) and cfg.level_weights == (2.0, 1.0) and hash(cfg)
    with pytest.raises(ValueError, match="level_weights"):
        ArithmeticConfig(levels=(1, 2), level_weights=(1.0,))
    with pytest.raises(ValueError, match="unknown level"):
        ArithmeticConfig(levels=(6,))


@settings(max_examples=25, deadline=None)
@given(
    total=st.integers(0, 10_000),
    weights=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=6).filter(lambda w: sum(w) > 0),
)
def test_level_counts_exact(total, weights):
    counts = level_counts(total, weights)
    assert sum(counts) == total
    share = np.asarray(weights) / sum(weights) * total
    assert np.all(np.abs(np.asarray(counts) - share) < 1.0 + 1e-9)


def test_levels_really_differ():
    """Level spaces: distinct problem counts and answer magnitudes grow with level."""
    rng = np.random.default_rng(0)
    stats = {}
    for lv, gen in LEVELS.items():
        probs = [gen(rng) for _ in range(3000)]
        answers = np.array([evaluate_expression(p) for p in probs])
        stats[lv] = (len(set(probs)), np.abs(answers).mean(), np.mean([len(p) for p in probs]))
    assert stats[1][1] < stats[2][1] < stats[4][1] < stats[5][1]
    assert stats[1][2] < stats[3][2] < stats[5][2]
    assert stats[1][0] <= 1000 and stats[4][0] <= 784 and stats[5][0] > 2900


def test_answer_is_correct():
    assert answer_is_correct("19", "19") and answer_is_correct(" 19\n", 19)
    assert answer_is_correct("-980", "-980") and answer_is_correct("019", "19")
    for wrong in ["", "19.0", "1 9", "+19", "19x", "18", "--19"]:
        assert not answer_is_correct(wrong, "19"), wrong


def test_answer_reward():
    np.testing.assert_array_equal(
        answer_reward(["19", "18", ""], ["19", "19", "0"]), [1.0, -1.0, -1.0]
    )
    np.testing.assert_array_equal(answer_reward(["7"], [7], scale="01"), [1.0])
    assert answer_reward(["1"], ["1"]).dtype == np.float32
    with pytest.raises(ValueError):
        answer_reward(["1"], [])


def test_sft_examples():
    train, _ = make_arithmetic(ArithmeticConfig(num_train=5, num_eval=0))
    pairs = sft_examples(train)
    assert pairs == [(ex["problem"] + "=", ex["answer"]) for ex in train]


def test_char_tokenizer():
    tok = CharTokenizer()
    assert tok.vocab_size == 51 < 64 and len(tok) == 51
    assert (tok.pad_id, tok.bos_id, tok.eos_ids) == (0, 1, (2,))
    ids = tok.encode("12+7=")
    assert ids == [5, 6, 14, 11, 18] and tok.decode(ids) == "12+7="
    assert tok.encode("1", add_bos=True) == [1, 5]
    assert tok.decode([5, 13, 2, 4, 0]) == "190"
    assert tok.decode([5, 13, 2, 4, 0], stop_at_eos=True) == "19"
    assert tok.decode([5, 2], skip_special_tokens=False) == "1<eos>"
    assert tok.encode("A") == [tok.unk_id]
    assert (
        tok.apply_chat_template(
            [{"role": "system", "content": "s"}, {"role": "user", "content": "3+4="}]
        )
        == "3+4="
    )
    with pytest.raises(ValueError):
        tok.decode([99])


@settings(max_examples=25, deadline=None)
@given(st.text(alphabet="0123456789+-*/=() .,?abcxyz", max_size=30))
def test_char_tokenizer_roundtrip(text):
    tok = CharTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text) and all(4 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_every_arithmetic_prompt_and_answer_tokenizes():
    tok = CharTokenizer()
    train, evals = make_arithmetic(ArithmeticConfig(num_train=300, num_eval=50))
    for ex in train + evals:
        for text in (format_prompt(ex["problem"]), ex["answer"]):
            assert tok.unk_id not in tok.encode(text)
