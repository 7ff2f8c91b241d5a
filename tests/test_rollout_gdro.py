"""Rollout-GDRO (spec gdro.md s.3; paper Eq. 17-21, Thm 4.2)."""

import itertools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from grpo_jax import gdro
from grpo_jax.gdro import rollout_gdro

BANDIT = gdro.RolloutGDROConfig()
PAPER_BANDIT = gdro.RolloutGDROConfig(mode="paper")
SQRT = gdro.RolloutGDROConfig(allocator="sqrt")


def check_allocation(cfg, alloc, num_prompts, total=None):
    n = np.asarray(alloc.rollouts_per_prompt)
    seg = np.asarray(alloc.segment_ids)
    r = num_prompts * cfg.n_bar if total is None else total
    assert n.shape == (num_prompts,) and n.dtype == np.int32
    assert int(n.sum()) == r and seg.shape == (r,)
    assert n.min() >= cfg.n_min and n.max() <= cfg.n_max
    np.testing.assert_array_equal(seg, np.repeat(np.arange(num_prompts), n))  # sorted, contiguous


@st.composite
def batches(draw, num_bins=(1, 3, 10), num_prompts=(1, 7, 40)):
    # Few distinct shapes (the jitted sqrt allocator compiles once per (P, B)); any bin counts.
    b = draw(st.sampled_from(num_bins))
    p = draw(st.sampled_from(num_prompts))
    bins = np.asarray(draw(st.lists(st.integers(0, b - 1), min_size=p, max_size=p)), np.int32)
    seed = draw(st.integers(0, 2**31 - 1))
    return b, bins, np.random.default_rng(seed)


def random_state(cfg, b, rng, scale=2.0):
    return gdro.rollout_gdro_init(cfg, b).replace(
        scores=jnp.asarray(rng.normal(0, scale, (b, cfg.num_arms)), jnp.float32),
        mu=jnp.asarray(rng.normal(), jnp.float32),
    )


# ----------------------------------------------------------------------------- budget


@settings(max_examples=25, deadline=None)
@given(batch=batches(), allocator=st.sampled_from(["bandit", "sqrt"]))
def test_exact_budget_and_bounds(batch, allocator):
    b, bins, rng = batch
    cfg = gdro.RolloutGDROConfig(allocator=allocator)
    state = random_state(cfg, b, rng)
    alloc = gdro.allocate(cfg, state, bins, bin_success=rng.random(b))
    check_allocation(cfg, alloc, len(bins))
    assert not bool(alloc.fallback)


@settings(max_examples=25, deadline=None)
@given(batch=batches(num_bins=(3, 10), num_prompts=(7, 40)))
def test_sqrt_within_one_of_continuous_neyman_when_no_bound_binds(batch):
    b, bins, rng = batch
    n_bar = 5
    cfg = gdro.RolloutGDROConfig(allocator="sqrt", n_min=2, n_max=20, n_bar=n_bar, v_floor=0.01)
    p = rng.uniform(0.0, 1.0, b) ** rng.choice([0.5, 1.0, 2.0])
    share = np.bincount(bins, minlength=b) / len(bins)
    sv = np.sqrt(p * (1 - p) + cfg.v_floor)
    n_star = n_bar * sv / np.sum(share * sv)  # Thm 4.2, continuous
    present = share > 0
    assume(np.all((n_star[present] > cfg.n_min) & (n_star[present] < cfg.n_max)))
    alloc = gdro.allocate(cfg, gdro.rollout_gdro_init(cfg, b), bins, bin_success=p)
    check_allocation(cfg, alloc, len(bins))
    n = np.asarray(alloc.rollouts_per_prompt)
    assert np.all(np.abs(n - n_star[bins]) < 1.0 + 1e-4)
    np.testing.assert_allclose(
        rollout_gdro.sqrt_targets(cfg, np.bincount(bins, minlength=b), p)[present],
        n_star[present],
        rtol=1e-4,
    )


def test_sqrt_gives_more_rollouts_to_uncertain_bins_and_respects_bounds():
    cfg = gdro.RolloutGDROConfig(allocator="sqrt", n_min=2, n_max=6, n_bar=4)
    bins = np.array([0] * 4 + [5] * 4 + [9] * 4)
    p = np.zeros(10)
    p[5] = 0.5
    p[9] = 1.0
    alloc = gdro.allocate(cfg, gdro.rollout_gdro_init(cfg, 10), bins, bin_success=p)
    check_allocation(cfg, alloc, 12)
    n = np.asarray(alloc.rollouts_per_prompt)
    assert np.all(n[4:8] == 6)  # the bound binds for the p = 0.5 bin
    assert np.all(n[:4] + n[8:] == 6)  # the remaining 24 rollouts split 3 / 3


def test_infeasible_budget_falls_back_with_exact_sum():
    state = gdro.rollout_gdro_init(BANDIT, 10)
    alloc = gdro.allocate(BANDIT, state, np.array([0, 0, 0]), total=13)  # 3 a = 13: no integer a
    assert bool(alloc.fallback)
    check_allocation(BANDIT, alloc, 3, total=13)
    np.testing.assert_array_equal(np.sort(alloc.rollouts_per_prompt), [4, 4, 5])
    alloc = gdro.allocate(BANDIT, state, np.array([1, 1, 4, 4]), total=17)  # even counts, odd R
    assert bool(alloc.fallback)
    check_allocation(BANDIT, alloc, 4, total=17)
    alloc = gdro.allocate(
        SQRT, state, np.array([1, 1, 4, 4]), bin_success=np.full(10, 0.5), total=17
    )
    check_allocation(SQRT, alloc, 4, total=17)
    with pytest.raises(ValueError, match="outside"):
        gdro.allocate(BANDIT, state, np.array([0, 0]), total=3)  # < P * n_min
    with pytest.raises(ValueError, match="outside"):
        gdro.allocate(BANDIT, state, np.array([0, 0]), total=25)  # > P * n_max


def test_initial_bandit_allocation_is_uniform():
    alloc = gdro.allocate(
        BANDIT, gdro.rollout_gdro_init(BANDIT, 10), np.array([0, 3, 3, 7, 9, 9, 9])
    )
    np.testing.assert_array_equal(alloc.rollouts_per_prompt, 4)


# ----------------------------------------------------------------------------- the DP


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    seed=st.integers(0, 10_000),
    extra=st.integers(-3, 3),
)
def test_dp_matches_brute_force(counts, seed, extra):
    counts = np.asarray(counts)
    assume(counts.sum() > 0)
    arms = np.arange(2, 6)
    rng = np.random.default_rng(seed)
    logp = np.log(rng.dirichlet(np.ones(len(arms)), size=len(counts)))
    total = int(counts.sum()) * 3 + extra
    got = gdro.solve_arms_dp(logp, counts, arms, total, 3)
    live = np.flatnonzero(counts > 0)
    best = -np.inf
    for ks in itertools.product(range(len(arms)), repeat=len(live)):
        if sum(counts[b] * arms[k] for b, k in zip(live, ks)) == total:
            best = max(best, sum(logp[b, k] for b, k in zip(live, ks)))
    if not np.isfinite(best):
        assert got is None
        return
    assert got is not None and np.all(got[counts == 0] == -1)
    assert sum(counts[b] * arms[got[b]] for b in live) == total
    assert sum(logp[b, got[b]] for b in live) == pytest.approx(best, abs=1e-5)


# ----------------------------------------------------------------------------- order and bins


@settings(max_examples=25, deadline=None)
@given(batch=batches(), allocator=st.sampled_from(["bandit", "sqrt"]))
def test_batch_order_does_not_change_any_prompts_allocation(batch, allocator):
    b, bins, rng = batch
    cfg = gdro.RolloutGDROConfig(allocator=allocator)
    state = random_state(cfg, b, rng)
    success = rng.random(b)
    ids = rng.permutation(1000)[: len(bins)]
    a = gdro.allocate(cfg, state, bins, success, prompt_ids=ids)
    perm = rng.permutation(len(bins))
    a2 = gdro.allocate(cfg, state, bins[perm], success, prompt_ids=ids[perm])
    np.testing.assert_array_equal(
        np.asarray(a2.rollouts_per_prompt), np.asarray(a.rollouts_per_prompt)[perm]
    )


@settings(max_examples=25, deadline=None)
@given(batch=batches(), allocator=st.sampled_from(["bandit", "sqrt"]))
def test_relabelling_bins_does_not_change_any_prompts_allocation(batch, allocator):
    # The patch's defect: its allocation depended on the order in which bins were listed.
    b, bins, rng = batch
    cfg = gdro.RolloutGDROConfig(allocator=allocator)
    state = random_state(cfg, b, rng)
    success = rng.random(b)
    ids = np.arange(len(bins))
    a = gdro.allocate(cfg, state, bins, success, prompt_ids=ids)
    relabel = rng.permutation(b)  # old bin j is listed as relabel[j]
    inv = np.argsort(relabel)
    state2 = state.replace(scores=state.scores[inv])
    a2 = gdro.allocate(cfg, state2, relabel[bins], success[inv], prompt_ids=ids)
    np.testing.assert_array_equal(a2.rollouts_per_prompt, a.rollouts_per_prompt)


def preferring(cfg, arm_of_bin, b):
    scores = np.full((b, cfg.num_arms), 5.0, np.float32)
    for bin_, arm in arm_of_bin.items():
        scores[bin_, arm - cfg.n_min] = -5.0
    return gdro.rollout_gdro_init(cfg, b).replace(scores=jnp.asarray(scores))


def test_allocation_goes_to_the_current_prompts_own_bins():
    state = preferring(BANDIT, {0: 3, 1: 6, 2: 4}, 3)
    a = gdro.allocate(BANDIT, state, np.array([1, 0, 2, 0]))
    np.testing.assert_array_equal(a.rollouts_per_prompt, [6, 3, 4, 3])
    np.testing.assert_array_equal(a.arm, [3, 6, 4])
    b = gdro.allocate(BANDIT, state, np.array([0, 0, 2, 1]))  # next batch: its own bins
    np.testing.assert_array_equal(b.rollouts_per_prompt, [3, 3, 4, 6])
    with pytest.raises(ValueError, match="prompt_bins"):  # stale labels are rejected
        gdro.rollout_gdro_update(BANDIT, state, b, np.array([1, 0, 2, 0]), np.zeros(16))


# ----------------------------------------------------------------------------- update


def test_paper_update_changes_arm_scores_and_mu_by_hand():
    BANDIT = PAPER_BANDIT  # feedback = the bin's mean loss signal
    b = 3
    state = gdro.rollout_gdro_init(BANDIT, b)
    bins = np.array([0, 0, 2, 2])

    def loss_rows(alloc):  # bin 0's rollouts lose 1, bin 2's lose 0.5
        return np.where(bins[np.asarray(alloc.segment_ids)] == 0, 1.0, 0.5).astype(np.float32)

    alloc = gdro.allocate(BANDIT, state, bins)  # uniform learners -> all 4
    np.testing.assert_array_equal(alloc.arm, [4, -1, 4])
    new, diag = gdro.rollout_gdro_update(BANDIT, state, alloc, bins, loss_rows(alloc))
    want = np.zeros((b, BANDIT.num_arms))
    want[0, 2] = 0.6 * 1.0  # (1 - ema_decay) * (-J_b), arm 4 = index 2
    want[2, 2] = 0.6 * 0.5
    np.testing.assert_allclose(new.scores, want, rtol=1e-6)
    assert float(new.mu) == pytest.approx(0.05 * (7.0 - 4.0), rel=1e-5)  # E[a] = 7 under uniform
    assert int(new.step) == 1 and diag["rollout_gdro/mu"] == pytest.approx(0.15, rel=1e-5)
    # Price on every arm: p_b(a) = 0.99 softmax(-0.65 (s_b + mu a)) + 0.01 / 11.
    arms = BANDIT.arms
    logits = -0.65 * (want[0] + 0.15 * arms)
    p0 = 0.99 * np.exp(logits) / np.exp(logits).sum() + 0.01 / 11
    np.testing.assert_allclose(gdro.arm_probs(BANDIT, new)[0], p0, rtol=1e-5)
    # Second step: EMA on the newly chosen arms, dual ascent with the learners that allocated.
    alloc2 = gdro.allocate(BANDIT, new, bins)
    new2, _ = gdro.rollout_gdro_update(BANDIT, new, alloc2, bins, loss_rows(alloc2))
    for bin_, loss in ((0, 1.0), (2, 0.5)):
        k = int(alloc2.arm[bin_]) - BANDIT.n_min
        assert float(new2.scores[bin_, k]) == pytest.approx(
            0.4 * want[bin_, k] + 0.6 * loss, rel=1e-5
        )
    probs = gdro.arm_probs(BANDIT, new)
    n_hat = 0.5 * probs[0] @ arms + 0.5 * probs[2] @ arms
    assert float(new2.mu) == pytest.approx(0.15 + 0.05 * (n_hat - 4), rel=1e-5)
    assert float(new2.mu) != float(new.mu)


def test_paper_price_pulls_expected_arm_towards_budget():
    BANDIT = PAPER_BANDIT
    state = gdro.rollout_gdro_init(BANDIT, 2)
    bins = np.array([0, 0, 1, 1])
    rng = np.random.default_rng(0)
    for _ in range(300):
        alloc = gdro.allocate(BANDIT, state, bins)
        check_allocation(BANDIT, alloc, 4)
        state, _ = gdro.rollout_gdro_update(
            BANDIT, state, alloc, bins, rng.normal(0, 0.1, 16).astype(np.float32)
        )
    n_hat = float(np.mean(gdro.arm_probs(BANDIT, state) @ BANDIT.arms))
    assert float(state.mu) > 0 and abs(n_hat - 4) < 0.25  # started at E[a] = 7


def test_sqrt_update_leaves_bandit_state():
    state = gdro.rollout_gdro_init(SQRT, 3)
    bins = np.array([0, 2])
    alloc = gdro.allocate(SQRT, state, bins, bin_success=np.array([0.2, 0.5, 0.5]))
    new, diag = gdro.rollout_gdro_update(
        SQRT, state, alloc, bins, np.ones(8), rewards=np.array([1, 0, 1, 0, 1, 1, 0, 0.0])
    )
    np.testing.assert_array_equal(new.scores, state.scores)
    assert float(new.mu) == 0.0 and int(new.step) == 1
    assert "rollout_gdro/wse_pooled" in diag and "rollout_gdro/wse" not in diag


def test_diagnostics_hand_values():
    cfg = gdro.RolloutGDROConfig(n_bar=3)
    state = preferring(cfg, {0: 2, 1: 4}, 2)
    bins = np.array([0, 1])
    alloc = gdro.allocate(cfg, state, bins)
    np.testing.assert_array_equal(alloc.rollouts_per_prompt, [2, 4])
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # var: 0.5 (n=2), 1/3 (n=4)
    d = gdro.rollout_gdro_diagnostics(cfg, state, alloc, rewards=rewards)
    np.testing.assert_allclose(d["rollout_gdro/budget_share"], [2 / 6, 4 / 6], rtol=1e-6)
    np.testing.assert_allclose(d["rollout_gdro/n_b"], [2, 4])
    s0, s1 = math.sqrt(0.5), math.sqrt(1 / 3)
    assert d["rollout_gdro/wse_pooled"] == pytest.approx(0.5 * (s0 / math.sqrt(2) + s1 / 2))
    assert d["rollout_gdro/wse_pooled_uniform"] == pytest.approx(0.5 * (s0 + s1) / math.sqrt(3))
    assert "rollout_gdro/wse" not in d
    np.testing.assert_allclose(d["gdro/bin_reward"], [0.5, 0.5])
    d = gdro.rollout_gdro_diagnostics(cfg, state, alloc, bin_success=np.array([0.5, 0.1]))
    assert d["rollout_gdro/wse"] == pytest.approx(0.5 * (0.5 / math.sqrt(2) + 0.3 / 2))
    assert d["rollout_gdro/wse_uniform"] == pytest.approx(0.5 * (0.5 + 0.3) / math.sqrt(3))
    assert d["rollout_gdro/wse_ratio"] == pytest.approx(
        d["rollout_gdro/wse"] / d["rollout_gdro/wse_uniform"]
    )
    assert d["rollout_gdro/alloc_entropy"] == pytest.approx(
        -(1 / 3 * math.log(1 / 3) + 2 / 3 * math.log(2 / 3))
    )


# ----------------------------------------------------------------------------- jit, state, config


def test_sqrt_allocator_is_jittable_with_static_shapes():
    cfg = SQRT

    @jax.jit
    def alloc(bins, success):
        n = gdro.sqrt_allocation(cfg, bins, success, jnp.arange(bins.shape[0]), 10)
        return n, jnp.repeat(jnp.arange(bins.shape[0]), n, total_repeat_length=bins.shape[0] * 4)

    rng = np.random.default_rng(0)
    for _ in range(3):
        bins = jnp.asarray(rng.integers(0, 10, 16), jnp.int32)
        n, seg = alloc(bins, jnp.asarray(rng.random(10), jnp.float32))
        assert int(n.sum()) == 64 and seg.shape == (64,)


def test_state_orbax_roundtrip_is_bit_exact(tmp_path):
    state = random_state(BANDIT, 10, np.random.default_rng(3))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", state)
    ckptr.wait_until_finished()
    r = ckptr.restore(tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    assert isinstance(r, gdro.RolloutGDROState)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(r)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    bins = np.array([0, 4, 4, 9])
    np.testing.assert_array_equal(
        gdro.allocate(BANDIT, state, bins).rollouts_per_prompt,
        gdro.allocate(BANDIT, r, bins).rollouts_per_prompt,
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n_min=1), "n_min"),
        (dict(n_min=0, n_bar=2), "n_min"),
        (dict(n_bar=13), "n_bar"),
        (dict(n_min=3, n_bar=2), "n_bar"),
        (dict(n_bar=4.5), "n_bar"),
        (dict(n_min=6, n_max=5, n_bar=5), "n_max"),
        (dict(allocator="greedy"), "allocator"),
        (dict(eta=0.0), "eta"),
        (dict(gamma=2.0), "gamma"),
        (dict(ema_decay=1.0), "ema_decay"),
        (dict(v_floor=0.0), "v_floor"),
        (dict(signal="x"), "signal"),
        (dict(feedback="reward"), "feedback"),
        (dict(mode="verl"), "mode"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        gdro.RolloutGDROConfig(**kwargs)


def test_unsorted_edges_raise_at_config_time():
    with pytest.raises(ValueError, match="edges"):
        gdro.ClassifierConfig(edges=(0.3, 0.1, 0.5))


def test_config_defaults_and_configdict():
    c = gdro.RolloutGDROConfig()
    assert (c.allocator, c.n_min, c.n_max, c.n_bar) == ("bandit", 2, 12, 4)
    assert (c.eta, c.gamma, c.ema_decay, c.alpha_mu, c.mu_0) == (0.65, 0.01, 0.4, 0.05, 0.0)
    assert (c.feedback, c.count_weighted_dp, c.signal) == ("variance", True, "failure_rate")
    section = ml_collections.ConfigDict(dict(allocator="sqrt", n_bar=8))
    assert gdro.RolloutGDROConfig(**section) == gdro.RolloutGDROConfig.from_dict(section)
    hash(c)


# ----------------------------------------------------------------------------- corrected default


def test_count_weighted_dp_by_hand():
    # gamma = 0: log p_b(a) = -0.65 s_b(a) - log Z_b. Bin 0 (1 prompt) likes arm 7 (score -8),
    # bin 1 (3 prompts) likes arm 4 (score -5); every other score 5. R = 16: either (7, 3) or
    # (4, 4). Unweighted: (7, 3) wins by 0.65 (13 - 10) = 1.95 nats. Weighted by N_b: (4, 4)
    # wins, 3 * 0.65 * 10 = 19.5 > 0.65 * 13 = 8.45.
    bins = np.array([0, 1, 1, 1])
    got = {}
    for weighted in (False, True):
        cfg = gdro.RolloutGDROConfig(gamma=0.0, count_weighted_dp=weighted)
        scores = np.full((2, cfg.num_arms), 5.0, np.float32)
        scores[0, 7 - cfg.n_min] = -8.0
        scores[1, 4 - cfg.n_min] = -5.0
        state = gdro.rollout_gdro_init(cfg, 2).replace(scores=jnp.asarray(scores))
        got[weighted] = np.asarray(gdro.allocate(cfg, state, bins).rollouts_per_prompt).tolist()
    assert got == {False: [7, 3, 3, 3], True: [4, 4, 4, 4]}


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 3), min_size=2, max_size=3),
    seed=st.integers(0, 10_000),
)
def test_count_weighted_dp_matches_brute_force(counts, seed):
    counts = np.asarray(counts)
    assume(counts.sum() > 0)
    cfg = gdro.RolloutGDROConfig(n_min=2, n_max=6, n_bar=4)
    rng = np.random.default_rng(seed)
    b = len(counts)
    state = random_state(cfg, b, rng)
    bins = np.repeat(np.arange(b), counts)
    a = gdro.allocate(cfg, state, bins)
    logp = np.log(gdro.arm_probs(cfg, state))
    live = np.flatnonzero(counts > 0)
    best = -np.inf
    for arms in itertools.product(cfg.arms, repeat=len(live)):
        if sum(counts[j] * x for j, x in zip(live, arms)) == counts.sum() * 4:
            best = max(best, sum(counts[j] * logp[j, x - cfg.n_min] for j, x in zip(live, arms)))
    n = np.asarray(a.rollouts_per_prompt)
    got = sum(counts[j] * logp[j, n[bins == j][0] - cfg.n_min] for j in live)
    assert got == pytest.approx(best, abs=1e-6)


def test_variance_feedback_update_by_hand():
    state = gdro.rollout_gdro_init(BANDIT, 3)
    bins = np.array([0, 0, 2, 2])
    alloc = gdro.allocate(BANDIT, state, bins)  # all arms tie -> n_bar
    np.testing.assert_array_equal(alloc.rollouts_per_prompt, [4, 4, 4, 4])
    rewards = np.array([1, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0], np.float32)
    # unbiased within-group variances: 1/3, 0, 1/4, 0; feedback (s^2 + 0.01) / 4, bin means
    with pytest.raises(ValueError, match="rewards"):
        gdro.rollout_gdro_update(BANDIT, state, alloc, bins, np.zeros(16))
    new, _ = gdro.rollout_gdro_update(BANDIT, state, alloc, bins, np.zeros(16), rewards)
    want = np.zeros((3, BANDIT.num_arms))
    want[0, 2] = 0.6 * ((1 / 3 + 0.01) / 4 + 0.01 / 4) / 2
    want[2, 2] = 0.6 * ((1 / 4 + 0.01) / 4 + 0.01 / 4) / 2
    np.testing.assert_allclose(new.scores, want, rtol=1e-5)
    assert float(new.mu) == pytest.approx(0.05 * (7.0 - 4.0), rel=1e-5)


def test_expected_variance_feedback_makes_the_dp_pick_the_integer_neyman_allocation():
    # Scores at their expectation (sigma_b^2 + v_floor) / a for every arm, gamma = 0: the
    # count-weighted DP minimises sum_b N_b v_b / a_b under the exact budget (any mu).
    cfg = gdro.RolloutGDROConfig(gamma=0.0, n_min=2, n_max=8, n_bar=4)
    v = np.array([0.25, 0.01, 0.09]) + cfg.v_floor
    counts = np.array([2, 3, 1])
    bins = np.repeat(np.arange(3), counts)
    scores = (v[:, None] / cfg.arms[None, :]).astype(np.float32)
    best, best_arms = np.inf, None
    for arms in itertools.product(cfg.arms, repeat=3):
        if np.dot(counts, arms) == 24:
            cost = float(np.sum(counts * v / np.asarray(arms)))
            if cost < best:
                best, best_arms = cost, list(arms)
    # By hand: bin 1 sits at n_min (continuous target 1.9); 2 n_0 + n_2 = 18 with n_0 / n_2 =
    # 0.51 / 0.32 gives 6.9 / 4.3, and (7, 4) costs 0.0993 against 0.1033 for (6, 6).
    assert best_arms == [7, 2, 4]
    for mu in (0.0, 0.3, -0.2):
        state = gdro.rollout_gdro_init(cfg, 3).replace(
            scores=jnp.asarray(scores), mu=jnp.asarray(mu, jnp.float32)
        )
        a = gdro.allocate(cfg, state, bins)
        np.testing.assert_array_equal(a.arm, best_arms)
    paper = gdro.RolloutGDROConfig(gamma=0.0, n_min=2, n_max=8, n_bar=4, count_weighted_dp=False)
    state = gdro.rollout_gdro_init(paper, 3).replace(scores=jnp.asarray(scores))
    # Unweighted: min sum_b v_b / a_b, (6, 2, 6) costs 0.0700 against 0.0721 for (7, 2, 4).
    np.testing.assert_array_equal(gdro.allocate(paper, state, bins).arm, [6, 2, 6])


def test_variance_bandit_learns_to_give_the_uncertain_bin_more():
    # Bin 0: p = 0.5, bin 1: p = 0.02 (4 prompts each). The sqrt rule gives bin 0 the larger arm.
    cfg = gdro.RolloutGDROConfig(n_min=2, n_max=8, n_bar=4)
    rng = np.random.default_rng(0)
    state = gdro.rollout_gdro_init(cfg, 2)
    bins = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    p = np.array([0.5, 0.02])
    last = []
    for step in range(60):
        a = gdro.allocate(cfg, state, bins)
        check_allocation(cfg, a, 8)
        seg = np.asarray(a.segment_ids)
        rewards = (rng.random(seg.size) < p[bins[seg]]).astype(np.float32)
        state, _ = gdro.rollout_gdro_update(cfg, state, a, bins, np.zeros(seg.size), rewards)
        if step >= 40:
            last.append(np.asarray(a.arm))
    last = np.asarray(last)  # the Neyman allocation is (6, 2); uniform would be (4, 4)
    assert np.mean(last[:, 0] > last[:, 1]) >= 0.8 and np.mean(last[:, 0]) >= 4.8


@settings(max_examples=25, deadline=None)
@given(batch=batches(), allocator=st.sampled_from(["bandit", "sqrt"]), data=st.data())
def test_unseen_prompts_get_n_bar_and_the_budget_stays_exact(batch, allocator, data):
    b, bins, rng = batch
    unseen = np.asarray(data.draw(st.lists(st.booleans(), min_size=len(bins), max_size=len(bins))))
    bins = np.where(unseen, b, bins).astype(np.int32)
    cfg = gdro.RolloutGDROConfig(allocator=allocator)
    state = random_state(cfg, b, rng)
    a = gdro.allocate(cfg, state, bins, bin_success=rng.random(b))
    check_allocation(cfg, a, len(bins))
    n = np.asarray(a.rollouts_per_prompt)
    np.testing.assert_array_equal(n[unseen], cfg.n_bar)
    assert a.arm.shape == (b,) and a.bin_rollouts.shape == (b,)
    if unseen.all():
        np.testing.assert_array_equal(n, cfg.n_bar)
    d = gdro.rollout_gdro_diagnostics(cfg, state, a, bin_success=rng.random(b))
    assert d["rollout_gdro/unseen_prompt_share"] == pytest.approx(unseen.mean())
    assert d["rollout_gdro/unseen_budget_share"] == pytest.approx(
        unseen.sum() * cfg.n_bar / n.sum()
    )


@settings(max_examples=40, deadline=None)
@given(batch=batches(num_bins=(3, 10), num_prompts=(7, 40)), data=st.data())
def test_sqrt_budget_exact_for_every_feasible_total(batch, data):
    b, bins, rng = batch
    unseen = np.asarray(data.draw(st.lists(st.booleans(), min_size=len(bins), max_size=len(bins))))
    bins = np.where(unseen, b, bins).astype(np.int32)
    cfg = SQRT
    total = data.draw(st.integers(len(bins) * cfg.n_min, len(bins) * cfg.n_max))
    success = rng.random(b) ** rng.choice([0.3, 1.0, 3.0])
    n = np.asarray(
        gdro.sqrt_allocation(
            cfg, jnp.asarray(bins), jnp.asarray(success), jnp.arange(len(bins)), b, total
        )
    )
    assert int(n.sum()) == total and n.min() >= cfg.n_min and n.max() <= cfg.n_max


@settings(max_examples=25, deadline=None)
@given(batch=batches(num_bins=(3, 10), num_prompts=(7, 40)))
def test_sqrt_allocation_monotone_in_variance(batch):
    b, bins, rng = batch
    cfg = gdro.RolloutGDROConfig(allocator="sqrt", n_min=2, n_max=12, n_bar=4)
    p = rng.random(b)
    a = gdro.allocate(cfg, gdro.rollout_gdro_init(cfg, b), bins, bin_success=p)
    n = np.asarray(a.rollouts_per_prompt)
    v = p * (1 - p)
    for i in np.unique(bins):
        for j in np.unique(bins):
            if v[i] > v[j] + 1e-6:  # more variance: no prompt gets fewer than a less-variable one
                assert n[bins == i].min() >= n[bins == j].max()
