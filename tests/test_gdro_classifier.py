"""Online difficulty classifier (spec gdro.md s.1; paper Eq. 10-11)."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax import gdro

EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def with_history(config, state, pid, ones, last_bin=None):
    """Fills prompt `pid`'s window (full: H visits) with `ones` correct visits."""
    h = config.history
    row = jnp.asarray([1] * ones + [0] * (h - ones), state.buffer.dtype)
    state = state.replace(buffer=state.buffer.at[pid].set(row), count=state.count.at[pid].set(h))
    if last_bin is not None:
        state = state.replace(last_bin=state.last_bin.at[pid].set(last_bin))
    return state


def orbax_roundtrip(tmp_path, tree):
    ckptr = ocp.StandardCheckpointer()
    path = tmp_path / "ckpt"
    ckptr.save(path, tree)
    ckptr.wait_until_finished()
    restored = ckptr.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))
    ckptr.close()
    return restored


# ----------------------------------------------------------------------------- hysteresis


@pytest.mark.parametrize(
    "ones, previous, expected",
    [
        (14, 3, 3),  # 0.28: within delta of edge 0.3 -> stays in bin 3
        (13, 3, 2),  # 0.26 <= 0.3 - 0.03 -> moves down to bin 2
        (16, 2, 2),  # 0.32 < 0.3 + 0.03 -> stays in bin 2
        (17, 2, 3),  # 0.34 >= 0.33 -> moves up to bin 3
    ],
)
def test_hysteresis_both_directions(ones, previous, expected):
    c = gdro.ClassifierConfig(edges=EDGES, history=50, delta=0.03)
    s = with_history(c, gdro.classifier_init(c, 3), 1, ones, last_bin=previous)
    assert int(gdro.classify(c, s, jnp.array([1]))[0]) == expected


@pytest.mark.parametrize(
    "ones, previous, expected", [(27, 3, 2), (33, 2, 3), (28, 3, 3), (32, 2, 2)]
)
def test_hysteresis_margin_is_inclusive(ones, previous, expected):
    # spec: up needs p >= e + delta, down needs p <= e - delta (H = 100 gives 0.27 / 0.33 exactly).
    c = gdro.ClassifierConfig(edges=EDGES, history=100, delta=0.03)
    s = with_history(c, gdro.classifier_init(c, 1), 0, ones, last_bin=previous)
    assert int(gdro.classify(c, s, jnp.array([0]))[0]) == expected


def _interval(b, edges):
    full = (0.0,) + tuple(edges) + (1.0 + 1e-9,)
    return full[b], full[b + 1]


@settings(max_examples=25, deadline=None)
@given(
    ones=st.integers(0, 50), previous=st.integers(0, 9), delta=st.sampled_from([0.0, 0.03, 0.05])
)
def test_hysteresis_dead_band_property(ones, previous, delta):
    c = gdro.ClassifierConfig(edges=EDGES, history=50, delta=delta)
    s = with_history(c, gdro.classifier_init(c, 1), 0, ones, last_bin=previous)
    b = int(gdro.classify(c, s, jnp.array([0]))[0])
    p = ones / 50
    raw = int(np.searchsorted(EDGES, p, side="right"))
    lo, hi = _interval(previous, EDGES)
    if delta == 0:
        assert b == raw
    elif lo - delta - 1e-9 <= p < hi + delta - 1e-9:
        assert b == previous  # within delta of its old bin: keeps it
    else:
        assert abs(b - raw) <= 1 and b != previous  # moved, to the raw bin or its neighbour
        blo, bhi = _interval(b, EDGES)
        assert blo - delta - 1e-6 <= p <= bhi + delta  # and p is within delta of the new bin


def test_moves_down_with_uniform_edges_and_delta():
    # The patch's defect: with uniform edges and delta > 0 a prompt never moved down a bin.
    c = gdro.ClassifierConfig(edges=EDGES, history=10, delta=0.03)
    s = gdro.classifier_init(c, 1)
    ids = jnp.array([0])
    for _ in range(10):
        s = gdro.classifier_update(c, s, ids, jnp.array([True]))
    assert int(gdro.classify(c, s, ids)[0]) == 9
    seen = []
    for _ in range(10):
        s = gdro.classifier_update(c, s, ids, jnp.array([False]))
        seen.append(int(gdro.classify(c, s, ids)[0]))
    assert seen[-1] == 0
    assert all(b2 <= b1 for b1, b2 in zip(seen, seen[1:]))  # monotone descent, no sticking


# ----------------------------------------------------------------------------- visits


def test_paper_unseen_prompts_land_in_unseen_bin():
    c = gdro.ClassifierConfig(mode="paper")
    s = gdro.classifier_init(c, 4)
    np.testing.assert_array_equal(gdro.classify(c, s, jnp.arange(4)), [0, 0, 0, 0])
    c5 = gdro.ClassifierConfig(unseen_bin=5, mode="paper")
    s5 = gdro.classifier_init(c5, 4)
    s5 = gdro.classifier_update(c5, s5, jnp.array([1]), jnp.array([True]))
    np.testing.assert_array_equal(gdro.classify(c5, s5, jnp.arange(4)), [5, 9, 5, 5])


def test_window_forgets_visits_older_than_history():
    c = gdro.ClassifierConfig(history=3, delta=0.0)
    s = gdro.classifier_init(c, 2)
    ids = jnp.array([0])
    est = []
    for outcome in [1, 1, 1, 0, 0, 0, 1]:
        s = gdro.classifier_update(c, s, ids, jnp.array([outcome]))
        est.append(float(gdro.success_estimate(c, s, ids)[0]))
    np.testing.assert_allclose(est, [1, 1, 1, 2 / 3, 1 / 3, 0, 1 / 3], atol=1e-6)
    assert int(s.count[0]) == 3 and int(s.count[1]) == 0


def test_classify_uses_past_visits_only_and_update_records_the_bin_used():
    c = gdro.ClassifierConfig(history=4, delta=0.0)
    s = gdro.classifier_init(c, 3)
    ids = jnp.array([0, 1])
    before = gdro.classify(c, s, ids)  # all unseen -> 0
    s = gdro.classifier_update(c, s, ids, jnp.array([True, False]))
    np.testing.assert_array_equal(s.last_bin[:2], before)  # bin used this step (pre-visit)
    np.testing.assert_array_equal(gdro.classify(c, s, ids), [9, 0])


def test_duplicate_ids_are_one_visit_combined_with_any():
    c = gdro.ClassifierConfig(history=5, mode="paper")
    s0 = gdro.classifier_init(c, 3)
    a = gdro.classifier_update(c, s0, jnp.array([2, 2, 0]), jnp.array([True, False, False]))
    b = gdro.classifier_update(c, s0, jnp.array([0, 2, 2]), jnp.array([False, False, True]))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert int(a.count[2]) == 1 and int(a.buffer[2].sum()) == 1 and int(a.count[0]) == 1


@pytest.mark.parametrize(
    "n, c, k", [(4, 1, 2), (4, 0, 2), (4, 3, 2), (8, 2, 4), (5, 5, 5), (6, 1, 1)]
)
def test_visit_outcome_pass_at_k_matches_combinatorial_formula(n, c, k):
    cfg = gdro.ClassifierConfig(statistic="pass_at_k", pass_k=k)
    correct = jnp.asarray([1] * c + [0] * (n - c), bool)
    got = float(gdro.visit_outcome(cfg, correct, jnp.zeros((n,), jnp.int32), 1)[0])
    want = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert got == pytest.approx(want, abs=1e-6)


def test_visit_outcome_any_correct_and_short_groups():
    seg = jnp.array([0, 0, 1, 1, 1, 2])
    corr = jnp.array([False, True, False, False, False, True])
    np.testing.assert_array_equal(
        gdro.visit_outcome(gdro.ClassifierConfig(statistic="any_correct"), corr, seg, 3), [1, 0, 1]
    )
    # pass@4 with groups of 2, 3 and 1 rollouts: all shorter than k -> any-correct.
    np.testing.assert_array_equal(
        gdro.visit_outcome(gdro.ClassifierConfig(statistic="pass_at_k", pass_k=4), corr, seg, 3),
        [1, 0, 1],
    )


def test_pass_at_k_buffer_stores_fractions():
    c = gdro.ClassifierConfig(statistic="pass_at_k", pass_k=2, history=4, delta=0.0)
    s = gdro.classifier_init(c, 1)
    assert s.buffer.dtype == jnp.float32
    for v in [0.5, 0.25]:
        s = gdro.classifier_update(c, s, jnp.array([0]), jnp.array([v]))
    assert float(gdro.success_estimate(c, s, jnp.array([0]))[0]) == pytest.approx(0.375)
    assert int(gdro.classify(c, s, jnp.array([0]))[0]) == 3


def test_bin_success_is_mean_estimate_per_bin():
    c = gdro.ClassifierConfig(history=4, delta=0.0)
    s = gdro.classifier_init(c, 3)
    s = with_history(c, s, 0, 1)  # 0.25
    s = with_history(c, s, 1, 2)  # 0.5
    s = with_history(c, s, 2, 2)  # 0.5
    ids = jnp.array([0, 1, 2])
    bins = gdro.classify(c, s, ids)
    np.testing.assert_array_equal(bins, [2, 5, 5])
    got = np.asarray(gdro.bin_success(c, s, ids, bins))
    want = np.zeros(10)
    want[2], want[5] = 0.25, 0.5
    np.testing.assert_allclose(got, want, atol=1e-6)


# ----------------------------------------------------------------------------- state and config


def test_state_orbax_roundtrip_is_bit_exact(tmp_path):
    for stat in gdro.classifier.STATISTICS:
        c = gdro.ClassifierConfig(history=6, statistic=stat)
        s = gdro.classifier_init(c, 20)
        rng = np.random.default_rng(0)
        for _ in range(9):
            ids = jnp.asarray(rng.integers(0, 20, 7))
            s = gdro.classifier_update(c, s, ids, jnp.asarray(rng.random(7), jnp.float32))
        r = orbax_roundtrip(tmp_path / stat, s)
        assert isinstance(r, gdro.ClassifierState)
        for x, y in zip(jax.tree.leaves(s), jax.tree.leaves(r)):
            assert np.asarray(x).dtype == np.asarray(y).dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_array_equal(
            gdro.classify(c, s, jnp.arange(20)), gdro.classify(c, r, jnp.arange(20))
        )
    assert (
        orbax_roundtrip(
            tmp_path / "int8",
            gdro.classifier_init(gdro.ClassifierConfig(statistic="any_correct"), 3),
        ).buffer.dtype
        == jnp.int8
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(edges=(0.5, 0.3)), "edges"),
        (dict(edges=(0.0, 0.5)), "edges"),
        (dict(edges=(0.5, 1.0)), "edges"),
        (dict(edges=(0.2, 0.2)), "edges"),
        (dict(history=0), "history"),
        (dict(delta=-0.1), "delta"),
        (dict(unseen_bin=10), "unseen_bin"),
        (dict(statistic="mean"), "statistic"),
        (dict(pass_k=0), "pass_k"),
        (dict(mode="released"), "mode"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        gdro.ClassifierConfig(**kwargs)


def test_config_from_configdict_and_hashable():
    section = ml_collections.ConfigDict(dict(edges=[0.25, 0.5, 0.75], history=8, delta=0.0))
    c = gdro.ClassifierConfig(**section)
    assert c.edges == (0.25, 0.5, 0.75) and c.num_bins == 4
    assert gdro.ClassifierConfig.from_dict(section) == c
    hash(c)
    with pytest.raises(ValueError, match="unknown"):
        gdro.ClassifierConfig.from_dict({"edges": (0.5,), "H": 3})


def test_classify_and_update_trace_under_jit():
    c = gdro.ClassifierConfig(history=4)
    s = gdro.classifier_init(c, 5)

    @jax.jit
    def step(s, ids, out):
        bins = gdro.classify(c, s, ids)
        return gdro.classifier_update(c, s, ids, out), bins

    s, bins = step(s, jnp.array([0, 3]), jnp.array([True, False]))
    s, bins = step(s, jnp.array([0, 3]), jnp.array([True, False]))
    np.testing.assert_array_equal(bins, [9, 0])


# ----------------------------------------------------------------------------- corrected default


def test_default_statistic_is_the_per_sample_success_rate():
    c = gdro.ClassifierConfig()
    assert c.statistic == "success_rate" and c.buffer_dtype == jnp.float32
    seg = jnp.array([0, 0, 0, 0, 1, 1, 1, 2])
    corr = jnp.array([True, False, True, False, False, False, False, True])
    np.testing.assert_allclose(gdro.visit_outcome(c, corr, seg, 3), [0.5, 0.0, 1.0])
    # Window mean of the per-visit fractions: 0.5, 0.25, 1.0 -> 7/12 (bin 5); H = 2 -> 0.625.
    for h, want, b in [(3, 7 / 12, 5), (2, 0.625, 6)]:
        cfg = gdro.ClassifierConfig(history=h, delta=0.0)
        s = gdro.classifier_init(cfg, 1)
        for v in (0.5, 0.25, 1.0):
            s = gdro.classifier_update(cfg, s, jnp.array([0]), jnp.array([v]))
        assert float(gdro.success_estimate(cfg, s, jnp.array([0]))[0]) == pytest.approx(want)
        assert int(gdro.classify(cfg, s, jnp.array([0]))[0]) == b


def test_success_rate_separates_prompts_any_correct_lumps_together():
    # 8 rollouts, per-sample success 2/8 and 7/8: any-correct puts both in the top bin.
    seg = jnp.repeat(jnp.arange(2), 8)
    corr = jnp.asarray([1, 1, 0, 0, 0, 0, 0, 0] + [1] * 7 + [0], bool)
    bins = {}
    for stat in ("success_rate", "any_correct"):
        c = gdro.ClassifierConfig(statistic=stat, delta=0.0)
        s = gdro.classifier_update(
            c, gdro.classifier_init(c, 2), jnp.arange(2), gdro.visit_outcome(c, corr, seg, 2)
        )
        bins[stat] = np.asarray(gdro.classify(c, s, jnp.arange(2))).tolist()
    assert bins == {"success_rate": [2, 8], "any_correct": [9, 9]}


def test_unseen_prompts_get_the_marker_and_no_anchor():
    c = gdro.ClassifierConfig(delta=0.03)
    assert c.unseen_index == c.num_bins == 10
    s = gdro.classifier_init(c, 3)
    np.testing.assert_array_equal(gdro.classify(c, s, jnp.arange(3)), [10, 10, 10])
    # First visit at p = 0.28: the raw bin 2. (Taking the marker as the hysteresis anchor would
    # give bin(p + delta) = 3.)
    s = gdro.classifier_update(c, s, jnp.array([1]), jnp.array([0.28]))
    assert int(s.last_bin[1]) == 10
    np.testing.assert_array_equal(gdro.classify(c, s, jnp.arange(3)), [10, 2, 10])
    # Never-solved prompts are seen and in bin 0, apart from the unseen ones.
    s = gdro.classifier_update(c, s, jnp.array([0]), jnp.array([0.0]))
    np.testing.assert_array_equal(gdro.classify(c, s, jnp.arange(3)), [0, 2, 10])


def test_duplicates_with_success_rate_are_averaged():
    c = gdro.ClassifierConfig(history=4)
    s0 = gdro.classifier_init(c, 2)
    a = gdro.classifier_update(c, s0, jnp.array([1, 0, 1]), jnp.array([0.5, 0.0, 1.0]))
    b = gdro.classifier_update(c, s0, jnp.array([1, 1, 0]), jnp.array([1.0, 0.5, 0.0]))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert int(a.count[1]) == 1 and float(a.buffer[1, 0]) == pytest.approx(0.75)


def test_bin_success_leaves_unseen_prompts_out():
    c = gdro.ClassifierConfig(history=4, delta=0.0)
    s = gdro.classifier_init(c, 3)
    s = gdro.classifier_update(c, s, jnp.array([0, 1]), jnp.array([0.25, 0.5]))
    ids = jnp.array([0, 1, 2])
    bins = gdro.classify(c, s, ids)
    np.testing.assert_array_equal(bins, [2, 5, 10])
    want = np.zeros(10)
    want[2], want[5] = 0.25, 0.5
    np.testing.assert_allclose(gdro.bin_success(c, s, ids, bins), want, atol=1e-7)


@settings(max_examples=25, deadline=None)
@given(
    fractions=st.lists(st.sampled_from([0.0, 0.125, 0.25, 1 / 3, 0.5, 0.75, 1.0]), max_size=12),
    h=st.sampled_from([1, 3, 5]),
)
def test_success_estimate_is_the_window_mean_of_visit_fractions(fractions, h):
    c = gdro.ClassifierConfig(history=h, delta=0.0)
    s = gdro.classifier_init(c, 2)
    for f in fractions:
        s = gdro.classifier_update(c, s, jnp.array([1]), jnp.array([f], jnp.float32))
    p = float(gdro.success_estimate(c, s, jnp.array([1]))[0])
    window = fractions[-h:]
    assert p == pytest.approx(float(np.mean(window)) if window else 0.0, abs=1e-6)
    b = int(gdro.classify(c, s, jnp.array([1]))[0])
    if window:
        assert b == int(np.searchsorted(np.float32(EDGES), np.float32(p), side="right"))
    else:
        assert b == 10
