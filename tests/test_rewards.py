"""Tests for grpo_jax.rewards: extraction, math-verify equivalences, the killable pool, datasets' golds."""

import os
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax.data import datasets
from grpo_jax.rewards import GoldParseError, RewardConfig, RewardFn, compute_rewards
from grpo_jax.rewards.extract import (
    answer_line,
    extract_answer,
    gsm8k_marker,
    last_boxed,
    last_number,
)
from grpo_jax.rewards.verify import VerifierPool, math_verify_check

HAVE_DATA = datasets.default_source_dir() is not None
needs_data = pytest.mark.skipif(not HAVE_DATA, reason="shared data directory not found")


# -------------------------------------------------------------------------------------------
# Injected checkers (resolved by name inside the worker processes).
# -------------------------------------------------------------------------------------------
def injected_checker(pred, gold):
    """'hang' sleeps far past any timeout, 'die' kills the worker, 'raise' raises."""
    if pred == "hang":
        time.sleep(3600)
    if pred == "die":
        os._exit(3)
    if pred == "raise":
        raise RuntimeError("checker bug")
    return pred == gold


CHECKER = f"{__name__}:injected_checker"


# The shared fixtures bypass the in-process integer fast path, so that every pair (integer golds
# included) is decided by math-verify in the workers.
@pytest.fixture(scope="module")
def math_fn():
    cfg = RewardConfig(task="math", num_workers=2, timeout_s=20.0, integer_fast_path=False)
    with RewardFn(cfg) as fn:
        yield fn


@pytest.fixture(scope="module")
def gsm8k_fn():
    cfg = RewardConfig(task="gsm8k", num_workers=2, timeout_s=20.0, integer_fast_path=False)
    with RewardFn(cfg) as fn:
        yield fn


# -------------------------------------------------------------------------------------------
# Extraction (pure).
# -------------------------------------------------------------------------------------------
def test_last_boxed_nested_and_last_one_counts():
    assert last_boxed(r"so $\boxed{\frac{a}{b}}$.") == r"\frac{a}{b}"
    assert last_boxed(r"\boxed{1} first, then \boxed{2}") == "2"
    assert last_boxed(r"\fbox{ 7 }") == "7"
    assert last_boxed(r"\boxed 5.") == "5"
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert last_boxed("no box here") is None
    assert last_boxed(r"\boxed{}") is None
    # A truncated last box is not replaced by an earlier complete one.
    assert last_boxed(r"\boxed{1} and \boxed{\frac{2}{3") is None
    multi = "\\boxed{\\begin{pmatrix} 1 \\\\\n 2 \\end{pmatrix}}"
    assert last_boxed(multi) == "\\begin{pmatrix} 1 \\\\\n 2 \\end{pmatrix}"


def test_answer_line_and_gsm8k_marker():
    assert answer_line("work...\nAnswer: 42") == "42"
    assert answer_line("Final Answer: $\\frac{1}{2}$.") == "\\frac{1}{2}"
    assert answer_line("Answer:\n\n  17\nmore") == "17"
    assert answer_line("**Answer:** 3") == "3"
    assert answer_line("The answer is 5") is None
    assert gsm8k_marker("blah\n#### 1,000") == "1,000"
    assert gsm8k_marker("#### 3\n#### $4.") == "$4"  # a currency sign, not a math delimiter
    assert extract_answer("#### 3\n#### $4.", "gsm8k") == ("4", "####")
    assert gsm8k_marker("none") is None
    assert last_number("a 1,234 b 5.50 c") == "5.5"
    assert last_number("owes -3 dollars") == "-3"
    assert last_number("none") is None


def test_extract_answer_orders():
    assert extract_answer("Answer: 3\n\\boxed{4}", "math") == ("4", "boxed")
    assert extract_answer("Answer: 3", "math") == ("3", "answer_line")
    assert extract_answer("\\boxed{4}\n#### 5", "gsm8k") == ("5", "####")
    assert extract_answer("so she pays $1,000.", "gsm8k") == ("1000", "last_number")
    assert extract_answer("#### 18 dollars", "gsm8k") == ("18", "####")
    assert extract_answer("\\boxed{\\frac{36}{2}}", "gsm8k") == ("\\frac{36}{2}", "boxed")
    assert extract_answer("", "math") == (None, "none")
    with pytest.raises(ValueError, match="unknown task"):
        extract_answer("x", "chess")


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(-(10**6), 10**6), min_size=1, max_size=4))
def test_last_boxed_property(values):
    text = " ".join(f"step \\boxed{{{v}}}" for v in values)
    assert last_boxed(text) == str(values[-1])


@settings(max_examples=25, deadline=None)
@given(st.integers(-(10**5), 10**5), st.integers(-(10**5), 10**5), st.booleans())
def test_integer_fast_path_agrees_with_math_verify(a, b, pad):
    """RewardFn compares integer answers in-process; math-verify must make the same decision."""
    pred = f"0{a}" if pad and a >= 0 else str(a)  # a leading zero, like AIME's "025"
    assert math_verify_check(pred, str(b)) == (a == b)
    _, correct, stats = compute_rewards(
        [f"\\boxed{{{pred}}}"], [str(b)], RewardConfig(task="math", num_workers=1)
    )
    assert correct[0] == (a == b) and stats["num_fast_path"] == 1


# -------------------------------------------------------------------------------------------
# Equivalences through the worker pool.
# -------------------------------------------------------------------------------------------
def test_equivalences(math_fn):
    cases = [  # (completion, gold, expected correct)
        (r"so the answer is $\boxed{0.5}$", r"\frac{1}{2}", True),
        (r"\boxed{\frac{1}{2}}", "0.5", True),
        (r"\boxed{\frac{a}{b}}", r"\frac{a}{b}", True),
        (r"\boxed{\frac{a}{b}}", "a", False),
        (r"first \boxed{3} then corrected: \boxed{4}", "4", True),
        (r"first \boxed{4} then corrected: \boxed{3}", "4", False),
        (r"\boxed{(0,1)}", "(0,1)", True),
        (r"\boxed{01}", "(0,1)", False),
        (r"\boxed{(0,1)}", "1", False),
        (
            "\\boxed{\\begin{pmatrix} 1 \\\\\n 2 \\end{pmatrix}}",
            r"\begin{pmatrix}1\\2\end{pmatrix}",
            True,
        ),
        (
            "\\boxed{\\begin{pmatrix} 1 \\\\\n 3 \\end{pmatrix}}",
            r"\begin{pmatrix}1\\2\end{pmatrix}",
            False,
        ),
        (r"\boxed{3\sqrt{2}}", r"\sqrt{18}", True),
        (r"\boxed{025}", "25", True),
        ("", "3", False),
        ("I don't know.", "3", False),
        (r"\boxed{}", "3", False),
    ]
    rewards, correct, stats = math_fn([c for c, _, _ in cases], [g for _, g, _ in cases])
    expected = np.array([e for _, _, e in cases])
    np.testing.assert_array_equal(correct, expected)
    np.testing.assert_array_equal(rewards, np.where(expected, 1.0, -1.0).astype(np.float32))
    assert rewards.dtype == np.float32 and correct.dtype == bool
    assert stats["num_no_answer"] == 3
    assert stats["num_timeouts"] == stats["num_crashes"] == stats["num_gold_errors"] == 0
    assert stats["num_format_ok"] == len(cases) - 3


def test_numeric_precision_distinguishes_tiny_values():
    """math-verify's default precision (15 digits) equates 1/2^99 and 1/2^98 (difference
    ~1.6e-30); ours (100 digits) does not. Decimal answers keep the float_rounding rule."""
    assert not math_verify_check("1/2^99", "1/2^98")
    assert not math_verify_check(r"\frac{1}{2^{99}}", r"\frac{1}{2^{98}}")
    assert math_verify_check(r"\frac{1}{2^{99}}", "2^{-99}")
    assert math_verify_check("1/2^99", "1/2^98", numeric_precision=15)  # the old behaviour
    assert math_verify_check(r"\text{13}", "13")
    assert math_verify_check("0.333333", r"\frac{1}{3}")
    assert not math_verify_check("0.333333", r"\frac{1}{3}", float_rounding=8)
    assert math_verify_check(r"\sqrt{2}\sqrt{3}", r"\sqrt{6}")  # irrational, exactly equal


def test_precision_option_reaches_the_workers(math_fn):
    completions = [
        r"\boxed{\frac{1}{2^{99}}}",
        r"\boxed{\text{13}}",
        r"\boxed{0.333333}",
        r"\boxed{1/2^{99}}",
    ]
    golds = [r"\frac{1}{2^{98}}", "13", r"\frac{1}{3}", "2^{-99}"]
    _, correct, stats = math_fn(completions, golds)  # default RewardConfig precision
    np.testing.assert_array_equal(correct, [False, True, True, True])
    assert stats["num_fast_path"] == 0 and stats["num_crashes"] == 0
    cfg = RewardConfig(task="math", num_workers=1, timeout_s=20.0, numeric_precision=15)
    _, correct, _ = compute_rewards(completions, golds, cfg)
    np.testing.assert_array_equal(correct, [True, True, True, True])
    for bad in (dict(numeric_precision=0), dict(float_rounding=-1)):
        with pytest.raises(ValueError):
            RewardConfig(**bad)


def test_gsm8k_commas_and_formats(gsm8k_fn):
    completions = [
        "... #### 1,000",
        "#### 1000",
        "so \\boxed{1,000}",
        "She has 1,000 apples.",
        "#### 1,001",
        "nothing numeric",
    ]
    _, correct, stats = gsm8k_fn(completions, ["1000", "1,000", "1000", "1000", "1000", "1000"])
    np.testing.assert_array_equal(correct, [True, True, True, True, False, False])
    assert stats["num_format_ok"] == 4  # ####/boxed; the last-number fallback is not the format
    assert stats["num_no_answer"] == 1


def test_scale_and_format_reward():
    completions = [r"\boxed{2}", r"\boxed{3}", "Answer: 2", "nothing"]
    golds = ["2"] * 4
    cfg = RewardConfig(task="math", scale="01", format_reward=0.25, num_workers=1)
    rewards, correct, _ = compute_rewards(completions, golds, cfg)
    np.testing.assert_array_equal(correct, [True, False, True, False])
    np.testing.assert_allclose(rewards, [1.25, 0.25, 1.0, 0.0])


def test_multi_part_gold(math_fn):
    golds = [["69", "84"]] * 4 + [["(1,2)", "(3,4)"]] * 2
    completions = [
        r"\boxed{69, 84}",
        r"\boxed{84, 69}",
        r"\boxed{69}",
        r"\boxed{69, 85}",
        r"\boxed{(3,4), (1,2)}",
        r"\boxed{(1,2)}",
    ]
    _, correct, _ = math_fn(completions, golds)
    np.testing.assert_array_equal(correct, [True, True, False, False, True, False])


def test_gold_that_does_not_parse_is_a_data_error(math_fn):
    assert not math_verify_check("1", "2")
    with pytest.raises(GoldParseError):
        math_verify_check("1", "")
    _, correct, stats = math_fn([r"\boxed{x}", r"\boxed{1}"], ["", "1"])
    assert correct.tolist() == [False, True] and stats["num_gold_errors"] == 1
    with RewardFn(RewardConfig(task="math", num_workers=1, on_gold_error="raise")) as fn:
        with pytest.raises(GoldParseError):
            fn([r"\boxed{1}"], [""])


def test_length_mismatch_and_bad_config():
    with pytest.raises(ValueError, match="2 completions but 1 golds"):
        RewardFn(RewardConfig(task="arithmetic"))(["1", "2"], ["1"])
    with pytest.raises(ValueError, match="task"):
        RewardConfig(task="chess")
    with pytest.raises(ValueError, match="scale"):
        RewardConfig(scale="pm2")
    with pytest.raises(ValueError, match="fork"):
        VerifierPool(start_method="fork")


def test_arithmetic_task_exact_integer():
    completions = ["19", " 19\n", "019", "19.0", "-5", "5", "", "19 ", "nineteen", "1 9"]
    golds = ["19", "19", "19", "19", "-5", "-5", "0", 19, "19", "19"]
    rewards, correct, stats = compute_rewards(completions, golds, RewardConfig(task="arithmetic"))
    np.testing.assert_array_equal(
        correct, [True, True, True, False, True, False, False, True, False, False]
    )
    np.testing.assert_array_equal(rewards, np.where(correct, 1.0, -1.0))
    assert stats["num_no_answer"] == 1
    assert stats["num_format_ok"] == 6


# -------------------------------------------------------------------------------------------
# Timeouts and crashes, called from a non-main thread.
# -------------------------------------------------------------------------------------------
def test_hang_and_crash_from_a_thread():
    cfg = RewardConfig(task="math", num_workers=2, timeout_s=1.5, checker=CHECKER)
    completions = [
        r"\boxed{hang}",
        r"\boxed{a}",
        r"\boxed{die}",
        r"\boxed{b}",
        r"\boxed{raise}",
        r"\boxed{c}",
        r"\boxed{hang}",
        r"\boxed{x}",
    ]
    golds = ["hang", "a", "die", "b", "raise", "c", "other", "y"]
    out = {}

    def target():
        with RewardFn(cfg) as fn:
            out["first"] = fn(completions, golds)
            out["second"] = fn([r"\boxed{a}", r"\boxed{b}"], ["a", "z"])  # pool still usable

    t0 = time.monotonic()
    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    _, correct, stats = out["first"]
    np.testing.assert_array_equal(correct, [False, True, False, True, False, True, False, False])
    assert stats["num_timeouts"] == 2
    assert stats["num_crashes"] == 2  # os._exit and an exception
    assert out["second"][1].tolist() == [True, False]
    assert time.monotonic() - t0 < 60


def test_pool_reports_bad_checker():
    with VerifierPool(num_workers=1, checker="no_such_module_xyz:f") as pool:
        with pytest.raises(RuntimeError, match="cannot start"):
            pool.run([("1", "1")])


# -------------------------------------------------------------------------------------------
# Every gold answer of GSM8K test and MATH-500 verifies against itself.
# -------------------------------------------------------------------------------------------
@needs_data
def test_gsm8k_test_golds_verify(gsm8k_fn):
    examples = datasets.load("gsm8k", "test")
    assert len(examples) == 1319
    # The reference solution (ending in "#### <answer>") is extracted and verifies.
    _, correct, stats = gsm8k_fn([e["solution"] for e in examples], [e["answer"] for e in examples])
    assert correct.all(), [e["answer"] for e, ok in zip(examples, correct) if not ok][:10]
    assert stats["num_format_ok"] == 1319
    # A wrong number never verifies.
    wrong = [f"#### {int(float(e['answer'])) + 1}" for e in examples[:50]]
    assert not gsm8k_fn(wrong, [e["answer"] for e in examples[:50]])[1].any()


@needs_data
def test_math500_golds_verify(math_fn):
    examples = datasets.load("math500", "test")
    assert len(examples) == 500
    golds = [e["answer"] for e in examples]
    _, correct, stats = math_fn([f"The answer is $\\boxed{{{g}}}$." for g in golds], golds)
    assert correct.all(), [g for g, ok in zip(golds, correct) if not ok][:10]
    assert stats["num_gold_errors"] == 0
    # The reference solutions' last \boxed{} agrees with the answer field too.
    _, correct, _ = math_fn([e["solution"] for e in examples], golds)
    assert correct.all()
