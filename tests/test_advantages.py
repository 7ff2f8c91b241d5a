"""Tests for grpo_jax.advantages.compute: hand values, regressions, properties, transforms."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax import advantages

ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def compute(rewards, segment_ids, num_segments, **kw):
    """``advantages.compute`` with the ``AdvantageConfig`` fields as keywords."""
    return advantages.compute(rewards, segment_ids, num_segments, advantages.AdvantageConfig(**kw))


def adv(rewards, seg, p, **kw):
    a, stats = compute(jnp.asarray(rewards, jnp.float32), jnp.asarray(seg, jnp.int32), p, **kw)
    return np.asarray(a), {k: int(v) for k, v in stats.items()}


def reference(rewards, seg, p, estimator, std="unbiased", eps=1e-6):
    """Independent per-group numpy reference (float64, explicit loops, leave-one-out for RLOO)."""
    rewards = np.asarray(rewards, np.float64)
    seg = np.asarray(seg)
    out = np.zeros_like(rewards)
    for g in range(p):
        idx = np.flatnonzero(seg == g)
        r = rewards[idx]
        if len(r) < 2 or np.all(r == r[0]):
            continue
        if estimator == "grpo":
            out[idx] = (r - r.mean()) / (np.std(r, ddof=1 if std == "unbiased" else 0) + eps)
        elif estimator == "dr_grpo":
            out[idx] = r - r.mean()
        else:
            out[idx] = [r[i] - np.delete(r, i).mean() for i in range(len(r))]
    return out


# ---------------------------------------------------------------- hand-computed values


def test_hand_values_one_group():
    r, s = [1.0, 1.0, 1.0, 0.0], [0, 0, 0, 0]
    # mean 0.75, deviations (.25, .25, .25, -.75); unbiased var .75/3 = .25 -> std .5
    a, _ = adv(r, s, 1, estimator="grpo", std="unbiased")
    np.testing.assert_allclose(a, np.array([0.25, 0.25, 0.25, -0.75]) / (0.5 + 1e-6), rtol=1e-6)
    # population var .75/4 = .1875
    a, _ = adv(r, s, 1, estimator="grpo", std="population")
    np.testing.assert_allclose(
        a, np.array([0.25, 0.25, 0.25, -0.75]) / (math.sqrt(0.1875) + 1e-6), rtol=1e-6
    )
    a, _ = adv(r, s, 1, estimator="dr_grpo")
    np.testing.assert_allclose(a, [0.25, 0.25, 0.25, -0.75], rtol=1e-6)
    # rloo: 1 - mean(1, 1, 0) = 1/3; 0 - mean(1, 1, 1) = -1
    a, _ = adv(r, s, 1, estimator="rloo")
    np.testing.assert_allclose(a, [1 / 3, 1 / 3, 1 / 3, -1.0], rtol=1e-6)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_regression_1110_finite_and_bounded(estimator):
    for std in ("unbiased", "population"):
        a, _ = adv([1.0, 1.0, 1.0, 0.0], [0, 0, 0, 0], 1, estimator=estimator, std=std)
        assert np.all(np.isfinite(a))
        assert np.max(np.abs(a)) <= math.sqrt(4) + 1e-6
        assert np.max(np.abs(a)) > 0.1


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("rewards", [[0.5] * 3, [0.9] * 3, [0.3] * 6, [0.1] * 7, [-3.3] * 2])
def test_all_equal_group_gives_exact_zeros(estimator, rewards):
    """Includes values whose float32 group mean is off by an ulp (0.9 * 3, 0.3 * 6, 0.1 * 7):
    a (r - mean) / (std + eps) would give about +-0.06 there instead of 0."""
    a, stats = adv(rewards, [0] * len(rewards), 1, estimator=estimator)
    np.testing.assert_array_equal(a, np.zeros(len(rewards)))
    assert stats["num_zero_std_groups"] == 1


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_unequal_groups_shuffled_match_reference(estimator):
    rng = np.random.default_rng(0)
    seg = np.array([0, 0, 1, 1, 1, 2, 3, 3, 3, 3, 3, 4, 4])  # sizes 2, 3, 1, 5, 2
    rewards = rng.integers(0, 3, size=seg.size).astype(np.float64) + rng.normal(size=seg.size)
    rewards[11:13] = 2.0  # group 4 all equal
    perm = rng.permutation(seg.size)
    for std in ("unbiased", "population"):
        a, stats = adv(rewards[perm], seg[perm], 5, estimator=estimator, std=std)
        np.testing.assert_allclose(
            a, reference(rewards[perm], seg[perm], 5, estimator, std), rtol=1e-5, atol=1e-6
        )
    assert stats == {
        "num_groups": 5,
        "num_singleton_groups": 1,
        "num_zero_std_groups": 1,
        "num_nonfinite_rewards": 0,
        "num_padding_rows": 0,
        "num_clipped": 0,
    }


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_singleton_and_padding_rows_are_zero(estimator):
    r = [1.0, 0.0, 5.0, 7.0, 3.0, 1.0]
    s = [0, 0, 1, -1, 9, 2]  # group 1 and 2 singletons; -1 and 9 (>= P=3) are padding
    a, stats = adv(r, s, 3, estimator=estimator)
    assert a[0] > 0 and a[1] < 0
    np.testing.assert_array_equal(a[2:], 0.0)
    assert stats["num_singleton_groups"] == 2
    assert stats["num_padding_rows"] == 2
    assert stats["num_groups"] == 3


def test_empty_group_is_not_counted():
    a, stats = adv([1.0, 0.0], [0, 0], 4)
    assert stats["num_groups"] == 1 and stats["num_singleton_groups"] == 0


def test_clip():
    r = [1.0] + [0.0] * 9  # A_0 = 0.9/0.316 = 2.85
    a, stats = adv(r, [0] * 10, 1, estimator="grpo", advantage_clip=1.5)
    ref = reference(r, [0] * 10, 1, "grpo")
    np.testing.assert_allclose(a, np.clip(ref, -1.5, 1.5), rtol=1e-5)
    assert a[0] == pytest.approx(1.5) and stats["num_clipped"] == 1


# ---------------------------------------------------------------- non-finite rewards


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_raises_by_default(bad):
    with pytest.raises(ValueError, match="non-finite"):
        adv([1.0, 0.0, bad, 1.0], [0, 0, 1, 1], 2)


def test_nonfinite_on_padding_row_does_not_raise():
    a, _ = adv([1.0, 0.0, np.nan], [0, 0, -1], 1)
    np.testing.assert_array_equal(a[2], 0.0)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_mask_keeps_other_groups_finite(estimator, bad):
    r = np.array([1.0, 0.0, 1.0, 0.5, bad, 0.0, 1.0])
    s = np.array([0, 0, 0, 1, 1, 1, 1])  # NaN in group "2" (id 1)
    a, stats = adv(r, s, 2, estimator=estimator, nonfinite="mask")
    assert np.all(np.isfinite(a))
    assert a[4] == 0.0
    assert stats["num_nonfinite_rewards"] == 1
    # group 1 unaffected; group 2 computed from its finite members only
    np.testing.assert_allclose(a[:3], reference(r[:3], s[:3], 1, estimator), rtol=1e-5)
    keep = np.array([3, 5, 6])
    np.testing.assert_allclose(a[keep], reference(r[keep], s[keep] - 1, 1, estimator), rtol=1e-5)


def test_nonfinite_raise_under_jit_masks_instead():
    f = jax.jit(functools.partial(compute, num_segments=2))
    a, stats = f(jnp.array([1.0, 0.0, jnp.nan, 1.0, 0.0]), jnp.array([0, 0, 1, 1, 1]))
    assert np.all(np.isfinite(np.asarray(a))) and int(stats["num_nonfinite_rewards"]) == 1


# ---------------------------------------------------------------- argument validation


def test_bad_arguments():
    r, s = jnp.zeros(4), jnp.zeros(4, jnp.int32)
    for kw in (
        {"estimator": "ppo"},
        {"std": "sample"},
        {"nonfinite": "ignore"},
        {"eps": -1.0},
        {"advantage_clip": -1.0},
        {"scale_rewards": "prompt"},
    ):
        with pytest.raises(ValueError, match=next(iter(kw))):
            compute(r, s, 1, **kw)
    # 0 (and None) turn the clip off: the default, as in TRL and verl
    r8 = jnp.array([1.0] + [0.0] * 29)  # one success in 30: A = 29 / sqrt(30) > 5
    for off in (0.0, None):
        a, stats = compute(r8, jnp.zeros(30, jnp.int32), 1, advantage_clip=off)
        assert float(a[0]) == pytest.approx(29 / np.sqrt(30), rel=1e-4)
        assert int(stats["num_clipped"]) == 0
    assert advantages.AdvantageConfig().advantage_clip == 0.0
    with pytest.raises(ValueError, match="num_segments"):
        compute(r, s, 1.5)
    with pytest.raises(AssertionError):
        compute(r, jnp.zeros(4), 1)  # float segment ids
    with pytest.raises(AssertionError):
        compute(r, jnp.zeros(3, jnp.int32), 1)


# ---------------------------------------------------------------- hypothesis properties

ROWS, GROUPS = 24, 4  # fixed shapes (padding rows get id -1) so eager ops compile once


@st.composite
def grouped_rewards(draw):
    sizes = draw(st.lists(st.integers(0, 6), min_size=GROUPS, max_size=GROUPS))
    seg = np.full(ROWS, -1)
    seg[: sum(sizes)] = np.repeat(np.arange(GROUPS), sizes)
    # rewards on a 0.25 grid: distinct values differ by >= 0.25, so eps is negligible
    rewards = (
        np.array(draw(st.lists(st.integers(-8, 8), min_size=ROWS, max_size=ROWS)), np.float64) / 4
    )
    perm = np.array(draw(st.permutations(range(ROWS))))
    return rewards[perm], seg[perm], GROUPS


@settings(max_examples=25, deadline=None)
@given(grouped_rewards(), st.sampled_from(ESTIMATORS), st.floats(-50, 50))
def test_property_shift_invariance_and_zero_group_mean(data, estimator, shift):
    r, s, p = data
    a, _ = adv(r, s, p, estimator=estimator)
    b, _ = adv(r + shift, s, p, estimator=estimator)
    np.testing.assert_allclose(a, b, atol=2e-3)
    for g in range(p):
        assert abs(a[s == g].sum()) < 1e-4
    np.testing.assert_allclose(a, reference(r, s, p, estimator), rtol=1e-4, atol=1e-5)
    assert np.all(a[s < 0] == 0)
    sizes = np.bincount(s[s >= 0], minlength=p)
    if estimator == "grpo":
        assert np.all(np.abs(a[s >= 0]) <= np.sqrt(sizes[s[s >= 0]]) + 1e-5)


@settings(max_examples=25, deadline=None)
@given(grouped_rewards(), st.floats(0.1, 100.0), st.sampled_from(["unbiased", "population"]))
def test_property_grpo_positive_scale_invariance(data, scale, std):
    r, s, p = data
    a, _ = adv(r, s, p, estimator="grpo", std=std)
    b, _ = adv(r * scale, s, p, estimator="grpo", std=std)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- jit / grad / vmap / sharding


def test_jit_vmap_grad():
    r = jnp.array([1.0, 0.0, 0.5, 2.0, 1.0, 1.0])
    s = jnp.array([0, 0, 0, 1, 1, 2])
    f = functools.partial(compute, num_segments=3, nonfinite="mask")
    eager, _ = f(r, s)
    jitted, _ = jax.jit(f)(r, s)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)
    batch = jnp.stack([r, 2 * r + 1, -r])
    vm, vstats = jax.vmap(f, in_axes=(0, None))(batch, s)
    for i in range(3):
        np.testing.assert_allclose(vm[i], f(batch[i], s)[0], rtol=1e-5, atol=1e-6)
    assert vstats["num_singleton_groups"].shape == (3,)
    # dr_grpo is linear in r: d(sum_i w_i A_i)/dr = (I - group mean) w
    w = jnp.arange(6.0)
    g = jax.grad(lambda x: jnp.sum(w * f(x, s, estimator="dr_grpo")[0]))(r)
    np.testing.assert_allclose(g, [-1, 0, 1, -0.5, 0.5, 0.0], atol=1e-6)


def test_sharded_over_data_axis_matches_single_device():
    devices = jax.devices()[:8]
    assert len(devices) == 8
    mesh = Mesh(np.array(devices), ("data",))
    rng = np.random.default_rng(1)
    seg = rng.integers(-1, 5, size=32).astype(np.int32)
    r = rng.integers(0, 3, size=32).astype(np.float32)
    sh = NamedSharding(mesh, PartitionSpec("data"))
    for estimator in ESTIMATORS:
        f = jax.jit(
            functools.partial(compute, num_segments=5, estimator=estimator, nonfinite="mask")
        )
        single, s1 = f(jnp.asarray(r), jnp.asarray(seg))
        sharded, s2 = f(jax.device_put(r, sh), jax.device_put(seg, sh))
        np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), rtol=1e-6, atol=1e-7)
        assert {k: int(v) for k, v in s1.items()} == {k: int(v) for k, v in s2.items()}


# ---------------------------------------------------------------- scale: group / batch / none


def test_scale_hand_values():
    """Groups {1, 0} and {2, 0, 1}: centred (.5, -.5, 1, -1, 0). Batch std of the raw rewards
    (1, 0, 2, 0, 1): mean .8, squared deviations .04 + .64 + 1.44 + .64 + .04 = 2.8, unbiased
    var 2.8 / 4 = .7, population 2.8 / 5 = .56 (TRL scale_rewards="batch")."""
    r, s = [1.0, 0.0, 2.0, 0.0, 1.0], [0, 0, 1, 1, 1]
    c = np.array([0.5, -0.5, 1.0, -1.0, 0.0])
    a, _ = adv(r, s, 2, scale_rewards="batch")
    np.testing.assert_allclose(a, c / (math.sqrt(0.7) + 1e-6), rtol=1e-6)
    a, _ = adv(r, s, 2, scale_rewards="batch", std="population")
    np.testing.assert_allclose(a, c / (math.sqrt(0.56) + 1e-6), rtol=1e-6)
    a, _ = adv(r, s, 2, scale_rewards="none")
    np.testing.assert_allclose(a, c, rtol=1e-6)
    # group stds: sqrt(.5) and 1 (unbiased)
    a, _ = adv(r, s, 2, scale_rewards="group")
    np.testing.assert_allclose(
        a, c / (np.array([1, 1, 0, 0, 0]) * math.sqrt(0.5) + [0, 0, 1, 1, 1] + 1e-6), rtol=1e-6
    )
    # rloo centring (n / (n - 1) (r - m): x2 and x1.5) divided by the batch std
    a, _ = adv(r, s, 2, estimator="rloo", scale_rewards="batch")
    np.testing.assert_allclose(a, c * [2, 2, 1.5, 1.5, 1.5] / (math.sqrt(0.7) + 1e-6), rtol=1e-6)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_scale_default_is_the_estimator_own(estimator):
    rng = np.random.default_rng(4)
    seg = np.array([0, 0, 1, 1, 1, 2, 2, 2, 2])
    r = rng.normal(size=seg.size)
    own = {"grpo": "group", "dr_grpo": "none", "rloo": "none"}[estimator]
    np.testing.assert_array_equal(
        adv(r, seg, 3, estimator=estimator)[0],
        adv(r, seg, 3, estimator=estimator, scale_rewards=own)[0],
    )
    # grpo with no scaling is dr_grpo
    np.testing.assert_array_equal(
        adv(r, seg, 3, scale_rewards="none")[0], adv(r, seg, 3, estimator="dr_grpo")[0]
    )


def test_batch_scale_with_padding_nonfinite_singletons_and_unequal_groups():
    """The batch std is over every grouped finite row (singleton members included, padding and
    masked non-finite rows excluded); uninformative groups still get exact zeros."""
    r = np.array([1.0, 0.0, 9.0, 2.0, 0.0, 1.0, np.nan, 7.0, 4.0, 4.0, 4.0])
    s = np.array([0, 0, -1, 1, 1, 1, 1, 2, 3, 3, 3])  # padding row 2, NaN in group 1, singleton 2
    a, stats = adv(r, s, 4, scale_rewards="batch", nonfinite="mask")
    pool = np.array([1.0, 0.0, 2.0, 0.0, 1.0, 7.0, 4.0, 4.0, 4.0])
    sd = np.std(pool, ddof=1)
    expect = np.array([0.5, -0.5, 0, 1.0, -1.0, 0.0, 0, 0, 0, 0, 0]) / (sd + 1e-6)
    np.testing.assert_allclose(a, expect, rtol=1e-6, atol=1e-7)
    assert stats["num_zero_std_groups"] == 1 and stats["num_singleton_groups"] == 1
    # a batch whose rewards are all equal: zeros, not NaN
    a, _ = adv([3.0] * 4, [0, 0, 1, 1], 2, scale_rewards="batch")
    np.testing.assert_array_equal(a, 0.0)


@settings(max_examples=25, deadline=None)
@given(grouped_rewards(), st.floats(0.1, 100.0), st.floats(-50, 50))
def test_property_batch_scale(data, scale, shift):
    """Group sums are zero, A is invariant to r -> scale * r + shift, and equals the group
    centring divided by one batch-wide constant."""
    r, s, p = data
    a, _ = adv(r, s, p, scale_rewards="batch")
    b, _ = adv(scale * r + shift, s, p, scale_rewards="batch")
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-3)
    for g in range(p):
        assert abs(a[s == g].sum()) < 1e-4
    c = reference(r, s, p, "dr_grpo")
    pool = r[s >= 0]
    if pool.size >= 2 and np.any(c != 0):
        np.testing.assert_allclose(a, c / (np.std(pool, ddof=1) + 1e-6), rtol=1e-4, atol=1e-5)


def test_scale_under_jit_and_bad_value():
    r = jnp.array([1.0, 0.0, 2.0, 0.0, 1.0])
    s = jnp.array([0, 0, 1, 1, 1])
    f = jax.jit(functools.partial(compute, num_segments=2, scale_rewards="batch", nonfinite="mask"))
    np.testing.assert_allclose(f(r, s)[0], adv(r, s, 2, scale_rewards="batch")[0], rtol=1e-6)
    with pytest.raises(ValueError, match="scale"):
        compute(r, s, 2, scale_rewards="prompt")


# ---------------------------------------------------------------- DAPO overlong penalty


def test_overlong_penalty_hand_values():
    """DAPO Eq. 13 with L_max = 20, L_cache = 4: 0 up to 16, then (16 - L) / 4, -1 beyond 20."""
    lengths = jnp.array([0, 10, 16, 17, 18, 19, 20, 21, 100])
    expect = np.array([0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    out = advantages.overlong_penalty(lengths, 20, 4)
    assert out.dtype == jnp.float32 and out.shape == (9,)
    np.testing.assert_allclose(out, expect, rtol=1e-6)
    np.testing.assert_allclose(
        advantages.overlong_penalty(lengths, 20, 4, 0.5), expect / 2, rtol=1e-6
    )
    # float lengths, under jit; cache = the whole budget: linear from 0 at L = 0
    f = jax.jit(advantages.overlong_penalty, static_argnums=(1, 2))
    np.testing.assert_allclose(f(jnp.array([0.0, 2.0, 8.0, 9.0]), 8, 8), [0, -0.25, -1, -1])


def test_overlong_penalty_bad_arguments():
    for max_len, cache_len in [(0, 1), (10, 0), (10, 11), (10, -2)]:
        with pytest.raises(ValueError):
            advantages.overlong_penalty(jnp.array([1]), max_len, cache_len)
    with pytest.raises(AssertionError):
        advantages.overlong_penalty(jnp.zeros((2, 2)), 10, 2)
