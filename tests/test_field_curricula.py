"""The field's pass-rate curricula (grpo_jax/algorithms/field.py) against hand-computed values."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from configs import arithmetic
from grpo_jax import algorithms, config_schema, gdro
from grpo_jax.algorithms import field
from grpo_jax.algorithms.base import CurriculumState, Visit
from grpo_jax.data.pipeline import PromptSource


def _curriculum(name, num_prompts=8, P=4, n=4, **section):
    c = arithmetic.get_config(f"{name},smoke")
    c.rollout.prompts_per_step, c.rollout.rollouts_per_prompt = P, n
    for key, value in section.items():
        c.curricula[{"learnability": "learnability", "online_filter": "filter"}.get(name, name)][
            key
        ] = value
    return algorithms.get(name).curriculum.from_config(config_schema.typed(c), num_prompts)


def _source(num=8, P=4, seed=3):
    return PromptSource([{"id": i} for i in range(num)], P, seed=seed)


def _visited(cur, ids, rates):
    """The curriculum's initial state after one classifier visit per prompt at ``rates``."""
    state = cur.init()
    cls = gdro.classifier_update(
        cur.classifier_config, state.classifier, np.asarray(ids, np.int32), np.asarray(rates)
    )
    return CurriculumState(classifier=cls, controller=state.controller)


# ----------------------------------------------------------------------------- DAPO / filter


def test_dapo_is_registered_and_keeps_groups_with_unequal_rewards():
    cur = _curriculum("dapo", n=2)
    assert cur.filters_groups and not algorithms.get("grpo").curriculum.filters_groups
    rewards = np.asarray([1, 1, -1, 1, -1, -1], np.float32)  # groups: all right, mixed, all wrong
    seg = np.repeat(np.arange(3), 2)
    kept = cur.keep_groups(cur.init(), np.arange(3), rewards, rewards > 0, seg)
    np.testing.assert_array_equal(kept, [False, True, False])


def test_pass_rate_band_is_closed():
    rates = np.asarray([0.0, 0.25, 0.5, 0.75, 1.0])
    np.testing.assert_array_equal(
        field.pass_rate_in_band(rates, 0.25, 0.75), [False, True, True, True, False]
    )
    np.testing.assert_array_equal(field.pass_rate_in_band(rates, 0.0, 1.0), [True] * 5)


def test_online_filter_group_and_window_estimates_by_hand():
    """Prompt 0 solved in both past visits and 2 of 4 now: its group rate 0.5 is in the band,
    its window estimate (1 + 1 + 0.5) / 3 = 0.833 is not. Prompt 1, never seen: 1/4 either way.
    Prompt 2: 4 of 4 now, group rate 1 (out); past visit 0 -> window 0.5 (in)."""
    ids = np.arange(3)
    correct = np.asarray([1, 1, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1], bool)
    seg = np.repeat(ids, 4)
    rewards = np.where(correct, 1.0, -1.0).astype(np.float32)
    group = _curriculum("online_filter")
    state = _visited(group, [0, 2], [1.0, 0.0])
    state = CurriculumState(
        classifier=gdro.classifier_update(
            group.classifier_config, state.classifier, np.asarray([0], np.int32), np.ones(1)
        ),
        controller=None,
    )
    np.testing.assert_array_equal(
        group.keep_groups(state, ids, rewards, correct, seg), [True, True, False]
    )
    window = _curriculum("online_filter", estimate="window")
    np.testing.assert_array_equal(
        window.keep_groups(state, ids, rewards, correct, seg), [False, True, True]
    )


def test_filter_configs_refuse_bad_values():
    with pytest.raises(ValueError, match="low <= high"):
        field.FilterConfig(low=0.8, high=0.2)
    with pytest.raises(ValueError, match="estimate"):
        field.FilterConfig(estimate="oracle")
    with pytest.raises(ValueError, match="uniform_mix"):
        field.LearnabilityConfig(uniform_mix=1.5)
    with pytest.raises(ValueError, match="p_min <= p_init"):
        field.GRESOConfig(p_init=0.01, p_min=0.1)


# ----------------------------------------------------------------------------- learnability


def test_learnability_probs_by_hand():
    p_hat = np.asarray([0.5, 0.1, 1.0, 0.0])
    seen = np.asarray([True, True, True, False])  # the last is unseen: assumed p = 0.5
    q = field.learnability_probs(p_hat, seen, field.LearnabilityConfig())
    np.testing.assert_allclose(q, np.asarray([0.25, 0.09, 0.0, 0.25]) / 0.59)
    q = field.learnability_probs(p_hat, seen, field.LearnabilityConfig(uniform_mix=0.2))
    np.testing.assert_allclose(q, 0.8 * np.asarray([0.25, 0.09, 0.0, 0.25]) / 0.59 + 0.05)
    # every prompt solved or failed: no learnability anywhere -> uniform
    q = field.learnability_probs(
        np.asarray([0.0, 1.0]), np.asarray([True, True]), field.LearnabilityConfig()
    )
    np.testing.assert_allclose(q, [0.5, 0.5])


@settings(max_examples=60, deadline=None)
@given(
    p=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40),
    mix=st.floats(0.0, 1.0),
    unseen=st.floats(0.0, 1.0),
    data=st.data(),
)
def test_learnability_probs_are_a_distribution(p, mix, unseen, data):
    seen = data.draw(st.lists(st.booleans(), min_size=len(p), max_size=len(p)))
    q = field.learnability_probs(
        np.asarray(p), np.asarray(seen), field.LearnabilityConfig(uniform_mix=mix, unseen_p=unseen)
    )
    assert q.shape == (len(p),) and np.all(q >= 0) and abs(q.sum() - 1.0) < 1e-9


def test_learnability_draw_follows_the_window_and_takes_exactly_P():
    cur = _curriculum("learnability")
    state = _visited(cur, np.arange(8), [0.0, 1.0, 0.5, 0.0, 1.0, 0.0, 1.0, 0.0])
    np.testing.assert_allclose(cur.draw_probs(state), [0, 0, 1, 0, 0, 0, 0, 0])
    src = _source()
    for step in range(1, 4):
        drawn = [ex["id"] for ex in cur.draw(state, src, step)]
        assert drawn == [2, 2, 2, 2]  # only prompt 2 has p (1 - p) > 0


def test_learnability_uniform_mix_one_is_grpo_stream():
    cur = _curriculum("learnability", uniform_mix=1.0)
    state = _visited(cur, np.arange(8), np.linspace(0, 1, 8))
    a, b = _source(), _source()
    for step in range(5):
        assert cur.draw(state, a, step) == b.next()


# ----------------------------------------------------------------------------- GRESO


def test_greso_skip_probs_by_hand():
    probs = field.greso_skip_probs([0, 1, 2, 3], [True, True, False, False], 0.5, 0.8)
    np.testing.assert_allclose(probs, [0.0, 0.5, 1 - 0.64, 1 - 0.512])


def test_greso_update_by_hand():
    cfg = field.GRESOConfig(p_init=0.5, delta=0.01, target=0.125)
    state = field.GRESOState(
        streak=np.asarray([2, 3, 1, 4]),
        last_easy=np.asarray([False, False, False, True]),
        p_easy=0.5,
        p_hard=0.5,
    )
    # prompts 0, 1, 2: all correct, mixed, all wrong (prompt 3 not visited)
    visit = Visit(
        ids=np.asarray([0, 1, 2], np.int32),
        correct=np.asarray([1, 1, 1, 0, 0, 0], bool),
        segment_ids=np.asarray([0, 0, 1, 1, 2, 2], np.int32),
    )
    new, diag = field.greso_update(cfg, state, [visit])
    np.testing.assert_array_equal(new.streak, [3, 0, 2, 4])
    np.testing.assert_array_equal(new.last_easy, [True, False, False, True])
    # each kind is 1/3 of the groups > 0.125: both exploration probabilities step down
    assert diag["greso/p_easy"] == pytest.approx(0.49) and float(new.p_hard) == pytest.approx(0.49)
    new, _ = field.greso_update(field.GRESOConfig(target=0.5, delta=0.01), state, [visit])
    assert float(new.p_easy) == pytest.approx(0.51)
    # the floor and the ceiling
    low = field.GRESOConfig(p_init=0.05, p_min=0.05, delta=0.1)
    new, _ = field.greso_update(low, state.replace(p_easy=0.1, p_hard=0.95), [visit])
    assert float(new.p_easy) == pytest.approx(0.05) and float(new.p_hard) == pytest.approx(0.85)


def test_greso_draw_skips_predicted_zero_variance_prompts_and_fills_to_P():
    """Exploration 0 for prompts with a zero-variance streak: they are never taken while others
    remain; the step still has exactly P prompts (filled in stream order after max_draws)."""
    cur = _curriculum("greso", max_draws=2)
    streak = np.asarray([1, 0] * 4)  # even ids were zero-variance last time
    ctrl = field.GRESOState(streak=streak, last_easy=np.zeros(8, bool), p_easy=0.0, p_hard=0.0)
    state = CurriculumState(classifier=cur.init().classifier, controller=ctrl)
    src, ref = _source(), _source()
    stream = [ex["id"] for ex in ref.next() + ref.next()]
    drawn = [ex["id"] for ex in cur.draw(state, src, 1)]
    assert drawn == [i for i in stream if i % 2] == sorted(drawn, key=stream.index)
    assert len(drawn) == 4
    # every prompt predicted zero-variance: after max_draws batches, the first P candidates
    ctrl = ctrl.replace(streak=np.ones(8, np.int64))
    state = CurriculumState(classifier=state.classifier, controller=ctrl)
    src, ref = _source(), _source()
    assert [ex["id"] for ex in cur.draw(state, src, 1)] == [ex["id"] for ex in ref.next()]


@settings(max_examples=25, deadline=None)
@given(
    streak=st.lists(st.integers(0, 5), min_size=8, max_size=8),
    easy=st.lists(st.booleans(), min_size=8, max_size=8),
    p=st.floats(0.0, 1.0),
    step=st.integers(1, 50),
)
def test_greso_draw_takes_exactly_P_and_exploration_one_is_grpo(streak, easy, p, step):
    ctrl = field.GRESOState(
        streak=np.asarray(streak), last_easy=np.asarray(easy), p_easy=p, p_hard=p
    )
    cur = _curriculum("greso")
    state = CurriculumState(classifier=None, controller=ctrl)
    drawn = cur.draw(state, _source(), step)
    assert len(drawn) == 4 and all(0 <= ex["id"] < 8 for ex in drawn)
    off = _curriculum("greso", p_init=1.0, p_min=1.0, delta=0.0)
    ctrl = ctrl.replace(p_easy=1.0, p_hard=1.0)
    state = CurriculumState(classifier=None, controller=ctrl)
    a, b = _source(), _source()
    assert off.draw(state, a, step) == b.next()


@pytest.mark.slow
def test_off_settings_train_exactly_like_grpo(tmp_path):
    """Exploration 1 (GRESO), a uniform draw (learnability), the band [0, 1] (filter) and no
    extra rounds (DAPO) give GRPO's metrics rows bit for bit (their own diagnostics aside)."""
    from grpo_jax import train, writers

    def rows(name, **section):
        c = arithmetic.get_config(f"{name},smoke")
        c.mesh.num_devices, c.logging.tensorboard, c.steps = 1, False, 2
        for key, value in section.items():  # dotted paths from the config root
            *parents, leaf = key.split(".")
            node = c
            for part in parents:
                node = node[part]
            node[leaf] = value
        train.train_and_evaluate(c, str(tmp_path / name))
        out = []
        for r in writers.read_jsonl(str(tmp_path / name / "metrics.jsonl")):
            if "reward_mean" in r:
                out.append(
                    {
                        k: v
                        for k, v in r.items()
                        if not k.startswith(("time/", "tokens_per_s/", "greso/", "dynamic_"))
                    }
                )
        return out

    base = rows("grpo")
    greso_off = {"curricula.greso.p_init": 1.0, "curricula.greso.p_min": 1.0}
    assert base and rows("greso", **greso_off, **{"curricula.greso.delta": 0.0}) == base
    assert rows("learnability", **{"curricula.learnability.uniform_mix": 1.0}) == base
    filter_off = {"curricula.filter.low": 0.0, "curricula.filter.high": 1.0}
    assert rows("online_filter", **filter_off) == base
    assert rows("dapo", **{"algorithm.dynamic_sampling_max_rounds": 0}) == base
