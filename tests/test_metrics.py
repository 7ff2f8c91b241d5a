"""Tests for grpo_jax.metrics: pass@k (vs exact binomials), mean@k, maj@k."""

from math import comb

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax import metrics


def exact_pass_at_k(n, c, k):
    return 1.0 - comb(n - c, k) / comb(n, k)


def test_pass_at_k_regressions():
    with pytest.raises(ValueError, match="k = 8 > n = 4"):
        metrics.pass_at_k(4, 0, 8)
    assert metrics.pass_at_k(10, 0, 1) == 0.0
    assert metrics.pass_at_k(10, 10, 5) == 1.0
    assert metrics.pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-12)
    assert metrics.pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-12)  # pass@1 = c / n
    assert metrics.pass_at_k(8, 1, 8) == 1.0  # n - c < k
    assert isinstance(metrics.pass_at_k(5, 2, 2), float)


def test_pass_at_k_vectorised_over_prompts():
    n = np.array([4, 8, 8, 16, 5])
    c = np.array([0, 1, 8, 3, 2])
    out = metrics.pass_at_k(n, c, 4)
    assert out.shape == (5,)
    np.testing.assert_allclose(out, [exact_pass_at_k(a, b, 4) for a, b in zip(n, c)], rtol=1e-12)
    # k broadcasts too
    np.testing.assert_allclose(
        metrics.pass_at_k(8, 2, np.array([1, 2, 8])),
        [exact_pass_at_k(8, 2, k) for k in (1, 2, 8)],
        rtol=1e-12,
    )


def test_pass_at_k_errors():
    with pytest.raises(ValueError, match="k = 8 > n = 4"):  # any prompt with k > n raises
        metrics.pass_at_k(np.array([8, 4]), np.array([1, 1]), 8)
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (0, 0, 1), (4.5, 1, 1), (4, 1, 1.5)]:
        with pytest.raises(ValueError):
            metrics.pass_at_k(n, c, k)


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 60).flatmap(
        lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))
    )
)
def test_property_pass_at_k_equals_exact_binomial(nck):
    n, c, k = nck
    got = metrics.pass_at_k(n, c, k)
    assert got == pytest.approx(exact_pass_at_k(n, c, k), abs=1e-9)
    assert 0.0 <= got <= 1.0
    if k < n:  # monotone in k
        assert metrics.pass_at_k(n, c, k + 1) >= got - 1e-12


def test_mean_at_k():
    correct = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    np.testing.assert_allclose(metrics.mean_at_k(correct), [0.5, 0.0, 1.0])
    # mean@k averaged over prompts equals pass@1 averaged over prompts
    np.testing.assert_allclose(
        metrics.mean_at_k(correct).mean(), metrics.pass_at_k(4, correct.sum(1), 1).mean()
    )
    with pytest.raises(ValueError):
        metrics.mean_at_k(np.zeros(4))
    with pytest.raises(ValueError):
        metrics.mean_at_k(np.full((2, 2), 2))


def test_maj_at_k():
    answers = [
        ["4", "5", "4", "6"],  # majority "4", correct
        ["4", "5", "5", "4"],  # tie 4/5: first occurrence "4" wins, "4" wrong
        ["7", None, None, None],  # None does not vote: "7" wins
        [None, None],  # no answer at all
        ["1/2", "0.5", "1/2"],  # majority "1/2"; correct flag set on one of its samples
    ]
    correct = [
        [True, False, True, False],
        [False, True, True, False],
        [True, False, False, False],
        [False, False],
        [False, False, True],
    ]
    np.testing.assert_array_equal(metrics.maj_at_k(answers, correct), [1, 0, 1, 0, 1])


def test_maj_at_k_errors():
    with pytest.raises(ValueError):
        metrics.maj_at_k([["1"]], [[True], [False]])
    with pytest.raises(ValueError):
        metrics.maj_at_k([["1", "2"]], [[True]])
    with pytest.raises(ValueError):
        metrics.maj_at_k([[]], [[]])


def test_weighted_standard_error_per_prompt_by_hand():
    # p = 0.5, 0.1, 0.9, 0: sigma 0.5, 0.3, 0.3, 0; n = 4, 2, 8, 4
    n, p = [4, 2, 8, 4], [0.5, 0.1, 0.9, 0.0]
    se = [0.5 / 2, 0.3 / np.sqrt(2), 0.3 / np.sqrt(8), 0.0]  # 0.25, 0.21213, 0.10607, 0
    assert metrics.weighted_standard_error(n, p) == pytest.approx(np.mean(se))  # 0.14205
    assert metrics.weighted_standard_error(n, p) == pytest.approx(0.142050, abs=1e-6)
    # weights: a weighted mean of the per-prompt errors
    w = [1.0, 3.0, 0.0, 0.0]
    assert metrics.weighted_standard_error(n, p, w) == pytest.approx((0.25 + 3 * se[1]) / 4)
    # per prompt, not per stratum: {0.5, 0.55} with n 2 and 6 is the mean of the two errors,
    # not sqrt(mean p(1-p)) / sqrt(mean n)
    got = metrics.weighted_standard_error([2, 6], [0.5, 0.55])
    assert got == pytest.approx((0.5 / np.sqrt(2) + np.sqrt(0.2475) / np.sqrt(6)) / 2)  # 0.27833
    assert metrics.weighted_standard_error([], []) == 0.0


def test_weighted_standard_error_errors():
    with pytest.raises(ValueError, match="shapes"):
        metrics.weighted_standard_error([4, 4], [0.5])
    with pytest.raises(ValueError, match="n_i"):
        metrics.weighted_standard_error([0, 4], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        metrics.weighted_standard_error([4], [np.nan])
    with pytest.raises(ValueError, match="weights"):
        metrics.weighted_standard_error([4, 4], [0.5, 0.5], [0.0, 0.0])


def test_weighted_standard_error_with_given_sigmas_by_hand():
    # sigma 0.5 / sqrt(4) and 0.3 / sqrt(9): mean of 0.25 and 0.1
    assert metrics.weighted_standard_error([4, 9], sigma=[0.5, 0.3]) == pytest.approx(0.175)
    # sigma = sqrt(p (1 - p)) is the success-rate form
    p = np.array([0.2, 0.5])
    assert metrics.weighted_standard_error([2, 6], sigma=np.sqrt(p * (1 - p))) == pytest.approx(
        metrics.weighted_standard_error([2, 6], p)
    )
    with pytest.raises(ValueError, match="exactly one"):
        metrics.weighted_standard_error([2], [0.5], sigma=[0.5])
    with pytest.raises(ValueError, match="sigma"):
        metrics.weighted_standard_error([2], sigma=[float("nan")])
