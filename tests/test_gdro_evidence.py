"""The shrunk Rollout-GDRO allocator: per-prompt evidence, the fitted Beta prior, the exact
greedy allocation, against hand-computed values, closed forms and brute force."""

import itertools
import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, stats

from grpo_jax import gdro
from grpo_jax.gdro import evidence

SHRUNK = gdro.RolloutGDROConfig(allocator="shrunk", n_min=2, n_max=8, n_bar=4)


# ----------------------------------------------------------------------------- the prior


def test_fit_beta_prior_by_hand():
    # rates 0, 0.5, 1 from 4 trials each: m = 6/12 = 0.5, var(rates) = 1/6,
    # noise = 0.25 * 1/4 = 1/16, v = 1/6 - 1/16 = 5/48, k = 0.25 / (5/48) - 1 = 1.4
    a, b = evidence.fit_beta_prior([0, 2, 4], [4, 4, 4])
    assert a == pytest.approx(0.7) and b == pytest.approx(0.7)
    # a homogeneous pool (no spread beyond the binomial noise): the strength hits its cap
    a, b = evidence.fit_beta_prior([1, 1, 1, 1], [4, 4, 4, 4])
    assert a + b == pytest.approx(evidence.MAX_STRENGTH)
    assert a / (a + b) == pytest.approx(0.25)
    # too little evidence: Beta(1, 1); a fixed strength keeps the fitted mean
    assert evidence.fit_beta_prior([0, 0], [0, 3]) == (1.0, 1.0)
    a, b = evidence.fit_beta_prior([0, 2, 4], [4, 4, 4], strength=10.0)
    assert (a, b) == pytest.approx((5.0, 5.0))


def test_posterior_moments_equal_the_beta_integrals():
    a, b = np.array([0.7, 3.0]), np.array([2.5, 0.4])
    for i in range(2):
        dist = stats.beta(a[i], b[i])
        var = integrate.quad(lambda p: p * (1 - p) * dist.pdf(p), 0, 1)[0]
        assert evidence.expected_variance(a[i : i + 1], b[i : i + 1])[0] == pytest.approx(var)
        for n in (1, 2, 5):
            inf = integrate.quad(lambda p: (1 - p**n - (1 - p) ** n) * dist.pdf(p), 0, 1)[0]
            got = evidence.expected_informative(a[i : i + 1], b[i : i + 1], [n])[0]
            assert got == pytest.approx(inf, rel=1e-6)
    pa, pb = evidence.posterior([3, 0], [5, 2], (0.5, 1.5))
    np.testing.assert_allclose(pa, [3.5, 0.5])
    np.testing.assert_allclose(pb, [3.5, 3.5])


@given(
    st.floats(0.05, 20),
    st.floats(0.05, 20),
    st.sampled_from(["informative", "variance"]),
)
@settings(max_examples=60, deadline=None)
def test_marginal_gains_are_the_differences_and_non_increasing(a, b, objective):
    a, b = np.array([a]), np.array([b])
    g = evidence.marginal_gains(a, b, 10, objective=objective, v_floor=0.01)[0]
    n = np.arange(1, 11)
    if objective == "informative":
        value = evidence.expected_informative(np.repeat(a, 10), np.repeat(b, 10), n)
        np.testing.assert_allclose(g[1:], np.diff(value), rtol=1e-6, atol=1e-12)
    else:
        v = evidence.expected_variance(a, b)[0] + 0.01
        np.testing.assert_allclose(g[1:], -np.diff(v / n), rtol=1e-9)
    assert np.all(np.diff(g) <= 1e-12)


# ----------------------------------------------------------------------------- the greedy


@given(st.integers(1, 4), st.integers(0, 10_000), st.sampled_from(["informative", "variance"]))
@settings(max_examples=40, deadline=None)
def test_greedy_allocation_is_the_brute_force_optimum(num, seed, objective):
    rng = np.random.default_rng(seed)
    a, b = rng.uniform(0.1, 5, num), rng.uniform(0.1, 5, num)
    lo = rng.integers(2, 4, num)
    upper = 6
    total = int(rng.integers(lo.sum(), num * upper + 1))
    g = evidence.marginal_gains(a, b, upper, objective=objective, v_floor=0.01)
    n = evidence.greedy_allocation(g, lo, upper, total, np.arange(num))
    assert n.sum() == total and np.all(n >= lo) and np.all(n <= upper)

    def value(m):
        return sum(g[i, lo[i] : m[i]].sum() for i in range(num))

    best = max(
        value(m)
        for m in itertools.product(*[range(lo[i], upper + 1) for i in range(num)])
        if sum(m) == total
    )
    assert value(n) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_greedy_allocation_budget_errors():
    g = np.zeros((2, 4))
    with pytest.raises(ValueError, match="outside"):
        evidence.greedy_allocation(g, [2, 2], 4, 3, [0, 1])
    with pytest.raises(ValueError, match="outside"):
        evidence.greedy_allocation(g, [2, 2], 4, 9, [0, 1])
    # all gains equal: ties go to the smaller k, then to the smaller id
    np.testing.assert_array_equal(evidence.greedy_allocation(g, [2, 2], 4, 5, [7, 3]), [2, 3])


# ----------------------------------------------------------------------------- the allocator


def _state(successes, trials):
    s = gdro.rollout_gdro_init(SHRUNK, 10, len(trials))
    return s.replace(
        successes=jnp.asarray(successes, jnp.float32), trials=jnp.asarray(trials, jnp.float32)
    )


def test_evidence_update_by_hand_with_decay_and_a_repeated_prompt():
    cfg = gdro.RolloutGDROConfig(allocator="shrunk", evidence_decay=0.5)
    s = _state([2, 0, 1], [4, 0, 4])
    # prompt 0 twice (groups of 2 and 1), prompt 2 once (2 rollouts)
    ids = np.array([0, 2, 0])
    seg = np.array([0, 0, 1, 1, 2])
    correct = np.array([1, 0, 1, 1, 1], bool)
    new = gdro.evidence_update(cfg, s, ids, correct, seg)
    np.testing.assert_allclose(new.successes, [0.5 * 2 + 2, 0, 0.5 * 1 + 2])
    np.testing.assert_allclose(new.trials, [0.5 * 4 + 3, 0, 0.5 * 4 + 2])
    # other allocators keep no evidence
    sq = gdro.RolloutGDROConfig(allocator="sqrt")
    assert gdro.evidence_update(sq, s, ids, correct, seg) is s


def test_shrunk_gives_the_frontier_more_than_the_settled_and_keeps_n_bar_for_little_evidence():
    # pool: prompt 0 never solved in 40 trials, 1 solved 1 of 20 (rare but solvable), 2 solved
    # 20 of 40, 3 always solved, 4 unseen; others fix the prior
    succ = [0, 1, 20, 40, 0] + [0, 5, 10, 0, 40]
    tri = [40, 20, 40, 40, 0] + [40, 40, 40, 40, 40]
    s = _state(succ, tri)
    ids = np.arange(5)
    n = gdro.rollout_gdro.shrunk_allocation(SHRUNK, s, ids)
    assert n.sum() == 5 * 4 and n.min() >= 2 and n.max() <= 8
    assert n[4] >= 4  # unseen: little evidence keeps >= n_bar
    assert n[1] > n[0] and n[1] > n[3]  # rare-but-solvable beats never / always solved
    assert n[1] > 4  # and gets more than uniform
    alloc = gdro.allocate(SHRUNK, s, np.full(5, 10), prompt_ids=ids)
    np.testing.assert_array_equal(alloc.rollouts_per_prompt, n)
    with pytest.raises(ValueError, match="prompt_ids"):
        gdro.allocate(SHRUNK, s, np.full(5, 10))


@given(st.integers(0, 10_000), st.integers(1, 30))
@settings(max_examples=40, deadline=None)
def test_shrunk_exact_budget_bounds_and_more_expected_informative_groups(seed, num):
    rng = np.random.default_rng(seed)
    trials = rng.integers(0, 30, 60).astype(float)
    succ = np.floor(trials * rng.uniform(0, 1, 60) ** 3)
    s = _state(succ, trials)
    ids = rng.choice(60, num, replace=False)
    n = gdro.rollout_gdro.shrunk_allocation(SHRUNK, s, ids)
    assert n.sum() == num * SHRUNK.n_bar
    assert n.min() >= SHRUNK.n_min and n.max() <= SHRUNK.n_max
    assert np.all(n[trials[ids] < SHRUNK.min_trials] >= SHRUNK.n_bar)
    _, a, b = gdro.rollout_gdro.shrunk_posterior(SHRUNK, s, ids)
    got = evidence.expected_informative(a, b, n).sum()
    uniform = evidence.expected_informative(a, b, np.full(num, SHRUNK.n_bar)).sum()
    assert got >= uniform - 1e-9  # uniform is feasible, the greedy is optimal


@given(st.floats(0.2, 5), st.floats(0.2, 5), st.floats(0.2, 5), st.floats(0.2, 5))
@settings(max_examples=60, deadline=None)
def test_variance_objective_is_monotone_in_the_estimated_variance(a1, b1, a2, b2):
    a, b = np.array([a1, a2]), np.array([b1, b2])
    v = evidence.expected_variance(a, b)
    g = evidence.marginal_gains(a, b, 12, objective="variance", v_floor=0.01)
    n = evidence.greedy_allocation(g, [2, 2], 12, 12, [0, 1])
    if v[0] > v[1] + 1e-12:
        assert n[0] >= n[1]
    elif v[1] > v[0] + 1e-12:
        assert n[1] >= n[0]


def test_shrunk_config_validation_names_the_field():
    for kwargs, field in [
        (dict(objective="entropy"), "objective"),
        (dict(evidence_decay=0.0), "evidence_decay"),
        (dict(min_trials=-1.0), "min_trials"),
        (dict(prior_strength=-2.0), "prior_strength"),
    ]:
        with pytest.raises(ValueError, match=field):
            gdro.RolloutGDROConfig(allocator="shrunk", **kwargs)
    with pytest.raises(ValueError, match="num_prompts"):
        gdro.rollout_gdro_init(SHRUNK, 10)
    assert gdro.RolloutGDROConfig(prior_strength=None).prior_strength == 0.0  # 0 = fitted


def test_update_diagnostics_report_the_posterior_expectations():
    s = _state([0, 1, 20, 40, 0], [40, 20, 40, 40, 0])
    ids = np.arange(5)
    alloc = gdro.allocate(SHRUNK, s, np.full(5, 10), prompt_ids=ids)
    rewards = np.zeros(int(alloc.rollouts_per_prompt.sum()), np.float32)
    _, d = gdro.rollout_gdro_update(
        SHRUNK, s, alloc, np.full(5, 10), rewards, rewards, prompt_ids=ids
    )
    (pa, pb), a, b = gdro.rollout_gdro.shrunk_posterior(SHRUNK, s, ids)
    assert d["rollout_gdro/prior_mean"] == pytest.approx(pa / (pa + pb))
    n = np.asarray(alloc.rollouts_per_prompt)
    want = sum(
        1
        - math.prod((a[i] + j) / (a[i] + b[i] + j) for j in range(n[i]))
        - math.prod((b[i] + j) / (a[i] + b[i] + j) for j in range(n[i]))
        for i in range(5)
    )
    assert d["rollout_gdro/expected_informative"] == pytest.approx(want)
    assert d["rollout_gdro/expected_informative"] >= d["rollout_gdro/expected_informative_uniform"]
