"""Tests for grpo_jax.data.arithmetic: problems, answers, splits, level mixes; and its
character tokenizer, grpo_jax.models.tokenizer.CharTokenizer."""

import collections
import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax.data.arithmetic import (
    LADDER_MAX,
    LEVELS,
    ArithmeticConfig,
    answer_is_correct,
    answer_reward,
    evaluate_expression,
    format_prompt,
    ladder_problem,
    level_counts,
    make_arithmetic,
    make_splits,
    mix_mean,
    sft_examples,
)
from grpo_jax.models.tokenizer import CharTokenizer

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


# ----------------------------------------------------------------------------- ladder, SFT pool


def test_ladder_problem_digits_and_answers():
    """d + 1 digits in all: ceil((d+1)/2) and floor((d+1)/2) per addend, no leading zeros."""
    rng = np.random.default_rng(0)
    expected = {1: (1, 1), 2: (2, 1), 3: (2, 2), 4: (3, 2), 5: (3, 3), 8: (5, 4), 9: (5, 5)}
    for d, (hi, lo) in expected.items():
        first_long = 0
        for _ in range(200):
            text = ladder_problem(d, rng)
            a, b = text.split("+")
            assert sorted((len(a), len(b)), reverse=True) == [hi, lo], (d, text)
            assert all(x == "0" or x[0] != "0" for x in (a, b)), text
            assert evaluate_expression(text) == int(a) + int(b)
            first_long += len(a) > len(b)
        if hi > lo:  # order swapped with probability 1/2
            assert 60 < first_long < 140
    assert ladder_problem(9, rng) != ladder_problem(9, rng)
    for bad in (0, LADDER_MAX + 1):
        with pytest.raises(ValueError, match="ladder difficulty"):
            ladder_problem(bad, rng)


def _ladder(**kw):
    base = dict(generator="ladder", levels=(2, 3, 4, 5), num_train=400, num_eval=80, seed=3)
    return ArithmeticConfig(**{**base, **kw})


def test_make_splits_sft_pool_disjoint_and_exact():
    cfg = _ladder(num_sft=600, sft_levels=(1, 2, 3, 4, 5))
    s = make_splits(cfg)
    assert [len(s[k]) for k in ("train", "sft", "eval")] == [400, 600, 80]
    train, sft, evals = ({ex["problem"] for ex in s[k]} for k in ("train", "sft", "eval"))
    assert not train & sft and not sft & evals and not train & evals
    assert collections.Counter(ex["level"] for ex in s["train"]) == dict.fromkeys((2, 3, 4, 5), 100)
    assert collections.Counter(ex["level"] for ex in s["eval"]) == dict.fromkeys((2, 3, 4, 5), 20)
    assert collections.Counter(ex["level"] for ex in s["sft"]) == dict.fromkeys(range(1, 6), 120)
    for split in s.values():
        assert [ex["id"] for ex in split] == list(range(len(split)))
        for ex in split:
            a, b = ex["problem"].split("+")
            assert ex["answer"] == str(int(a) + int(b)) and len(a) + len(b) == ex["level"] + 1
    # the SFT pool is an addition: train and eval are the same as without it
    plain = make_splits(_ladder())
    assert plain["train"] == s["train"] and plain["eval"] == s["eval"] and plain["sft"] == []
    # train_pool="sft" serves the SFT pool as the experiment's training list
    assert make_arithmetic(dataclasses.replace(cfg, train_pool="sft")) == (s["sft"], s["eval"])
    assert make_arithmetic(cfg) == (s["train"], s["eval"])


def test_make_splits_seeded_and_sft_mix():
    a, b = make_splits(_ladder(num_sft=50)), make_splits(_ladder(num_sft=50))
    c = make_splits(_ladder(num_sft=50, seed=4))
    assert a == b and a["train"] != c["train"] and a["sft"] != c["sft"]
    # default SFT mix = the train mix; explicit weights
    cfg = _ladder(num_sft=90, level_weights=(2.0, 1.0, 0.0, 0.0))
    assert collections.Counter(ex["level"] for ex in make_splits(cfg)["sft"]) == {2: 60, 3: 30}
    cfg = _ladder(num_sft=40, sft_levels=(1, 2), sft_level_weights=(3.0, 1.0))
    assert collections.Counter(ex["level"] for ex in make_splits(cfg)["sft"]) == {1: 30, 2: 10}


def test_ladder_config_validation():
    with pytest.raises(ValueError, match="unknown level"):
        ArithmeticConfig(generator="ladder", levels=(LADDER_MAX + 1,))
    with pytest.raises(ValueError, match="unknown level"):
        ArithmeticConfig(levels=(1, 2), sft_levels=(6,))  # the five kinds: 1..5
    with pytest.raises(ValueError, match="generator"):
        ArithmeticConfig(generator="digits")
    with pytest.raises(ValueError, match="num_sft > 0"):
        ArithmeticConfig(train_pool="sft")
    with pytest.raises(ValueError, match="train_pool"):
        ArithmeticConfig(train_pool="eval", num_sft=1)
    with pytest.raises(ValueError, match="sft_level_weights"):
        ArithmeticConfig(num_sft=1, sft_levels=(1, 2), sft_level_weights=(1.0,))
    cfg = ArithmeticConfig(generator="ladder", levels=[6, 9], sft_levels=[1], num_sft=1)
    assert cfg.levels == (6, 9) and cfg.sft_levels == (1,) and hash(cfg)


def test_mix_mean_hand_values():
    per_level = {"2": {"mean_at_1": 0.8}, "3": {"mean_at_1": 0.4}, "4": {"mean_at_1": 0.1}}
    assert mix_mean(per_level, {2: 1, 3: 1, 4: 2}) == pytest.approx((0.8 + 0.4 + 0.2) / 4)
    assert mix_mean({2: 0.8, 3: 0.4}, {2: 3.0, 9: 5.0}) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        mix_mean({2: 0.8}, {3: 1.0})


def test_frontier_config():
    """configs/arithmetic.py:<algo>,frontier: RL pool = steps * P / 5, disjoint from SFT."""
    from configs import arithmetic as arith_cfg

    c = arith_cfg.get_config("rollout_gdro,frontier")
    assert c.algorithm.name == "rollout_gdro"
    a = ArithmeticConfig(**c.data.arithmetic.to_dict())
    assert a.generator == "ladder" and a.num_sft > 0 and a.train_pool == "rl"
    assert c.steps * c.rollout.prompts_per_step / a.num_train == 5
    assert c.eval.num_samples >= 32 and min(a.num_eval, c.eval.max_examples) >= 1000
    longest = ladder_problem(max(a.levels), np.random.default_rng(0))
    assert len(format_prompt(longest)) <= c.data.max_prompt_tokens
    assert c.rollout.max_new_tokens >= len(str(2 * 10 ** ((max(a.levels) + 2) // 2))) + 1
    # the other variants keep their values
    d = arith_cfg.get_config("grpo")
    assert (d.steps, d.rollout.prompts_per_step, d.rollout.rollouts_per_prompt) == (100, 64, 8)
    assert d.data.arithmetic.levels == (1, 2, 3) and d.sft.steps == 300
    assert "generator" not in d.data.arithmetic


@pytest.mark.parametrize(
    "arg, named",
    [
        ("grpo,heavy_tailed,long", ("'heavy_tailed'", "'long'")),
        ("prompt_gdro,frontier,heavy_tailed", ("'heavy_tailed'", "'frontier'")),
        ("grpo,pool,long", ("'long'", "'pool'")),
        ("grpo,frontier,pool,smoke", ("'frontier'", "'pool'")),
    ],
)
def test_conflicting_testbed_flags_are_refused(arg, named):
    """Two flags that each set the testbed are refused in one line naming both (before, `,long`
    silently reset `,heavy_tailed`'s mix)."""
    from configs import arithmetic as arith_cfg

    with pytest.raises(ValueError, match="cannot be combined") as e:
        arith_cfg.get_config(arg)
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in named)
    # frontier + long is the long testbed (long implies frontier), not a conflict
    assert arith_cfg.get_config("grpo,frontier,long").steps == 200


def test_pool_config_shape():
    """`,pool`: the long horizon (>= 15 visits, controller-free first pass <= 10% of the run)
    over a heavy-tailed ladder mix with fresh problems (generator seed != 0)."""
    from configs import arithmetic as arith_cfg

    c = arith_cfg.get_config("rollout_gdro,pool")
    a = ArithmeticConfig(**c.data.arithmetic.to_dict())
    P, N = c.rollout.prompts_per_step, a.num_train
    assert c.steps * P / N >= 15 and (N / P) / c.steps <= 0.10
    w = a.train_weights()
    # the two easiest d are the majority; the hardest (never in the warm start) a thin tail
    assert w[0] + w[1] > 0.5 and 0.05 <= w[-1] <= 0.2
    assert a.seed != 0 and a.generator == "ladder" and max(a.levels) not in a.sft_mix()[0]
    assert c.algorithm.mini_batch_size * 2 == P * c.rollout.rollouts_per_prompt
    train, evals = make_arithmetic(dataclasses.replace(a, num_sft=200, num_eval=80))
    assert len(train) == N and {ex["level"] for ex in train} == set(a.levels)
