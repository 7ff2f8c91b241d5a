"""Prompt-GDRO (spec gdro.md s.2; paper Eq. 12-16)."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_losses import pl

from grpo_jax import gdro

# 3-bin batch: bin 0 has 2 rollouts, bin 1 has 4, bin 2 has 2.
BINS = np.array([0, 0, 1, 1, 1, 1, 2, 2], np.int32)
LOSS = np.array([1.0, 3.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0], np.float32)


def hand_q(scores, present, eta=0.65, gamma=0.01):
    omega = {b: math.exp(eta * scores[b]) for b in present}
    z = sum(omega.values())
    return {b: (1 - gamma) * omega[b] / z + gamma / len(present) for b in present}


def hand_weights(q, bins):
    total = sum(q[b] for b in bins)
    return [q[b] * len(bins) / total for b in bins]


PAPER = gdro.PromptGDROConfig(mode="paper")


def test_paper_hand_computed_scores_q_and_weights_over_two_steps():
    cfg = PAPER
    s = gdro.prompt_gdro_init(cfg, 3)
    # Step 1. Shares 0.25/0.5/0.25; bin means 2, 0.5, 0 -> debiased 8, 1, 0; first obs sets S.
    s, diag = gdro.prompt_gdro_update(cfg, s, jnp.asarray(BINS), jnp.asarray(LOSS))
    np.testing.assert_allclose(s.score, [8.0, 1.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(diag["gdro/q"], [1 / 3] * 3, rtol=1e-6)  # q used: zero scores
    q = hand_q([8.0, 1.0, 0.0], [0, 1, 2])
    np.testing.assert_allclose(
        gdro.prompt_gdro_q(cfg, s, jnp.asarray(BINS)), [q[0], q[1], q[2]], rtol=1e-5
    )
    w = gdro.prompt_gdro_weights(cfg, s, jnp.asarray(BINS))
    np.testing.assert_allclose(w, hand_weights(q, BINS.tolist()), rtol=1e-5)
    assert float(w[0]) == pytest.approx(3.858, abs=2e-3)  # worked by hand
    # Step 2: bins 0 and 2 only (shares 0.25 / 0.75), all losses 1 -> debiased 4 and 4/3.
    bins2 = np.array([0, 2, 2, 2], np.int32)
    s, diag = gdro.prompt_gdro_update(cfg, s, jnp.asarray(bins2), jnp.ones(4))
    want = [0.88 * 8 + 0.12 * 4, 1.0, 0.88 * 0 + 0.12 * 4 / 3]  # bin 1 absent: keeps its score
    np.testing.assert_allclose(s.score, want, rtol=1e-5)
    q_used = hand_q([8.0, 1.0, 0.0], [0, 2])  # pre-update scores, bins 0, 2
    np.testing.assert_allclose(diag["gdro/q"], [q_used[0], 0.0, q_used[2]], rtol=1e-5)
    q2 = hand_q(want, [0, 2])
    np.testing.assert_allclose(
        gdro.prompt_gdro_weights(cfg, s, jnp.asarray(bins2)),
        hand_weights(q2, bins2.tolist()),
        rtol=1e-5,
    )


def test_score_clip_bounds_the_exponent():
    cfg = gdro.PromptGDROConfig(score_clip=2.0, gamma=0.0)
    s = gdro.prompt_gdro_init(cfg, 2).replace(score=jnp.array([50.0, 0.0]))
    q = gdro.prompt_gdro_q(cfg, s, jnp.array([0, 1]))
    e = math.exp(0.65 * 2.0)
    np.testing.assert_allclose(q, [e / (e + 1), 1 / (e + 1)], rtol=1e-6)
    # score_clip = 0 means "no clip" (config convention), and huge scores stay finite.
    s = s.replace(score=jnp.array([5000.0, 0.0]))
    q = gdro.prompt_gdro_q(gdro.PromptGDROConfig(score_clip=0.0), s, jnp.array([0, 1]))
    assert np.all(np.isfinite(q)) and float(q[1]) == pytest.approx(0.005, rel=1e-5)


# Few distinct shapes (each compiles once); any scores and bin memberships.
scores_st = st.sampled_from([1, 3, 10]).flatmap(
    lambda b: st.lists(st.floats(-30, 30, allow_nan=False), min_size=b, max_size=b)
)


def draw_bins(data, b):
    r = data.draw(st.sampled_from([1, 9, 64]))
    return np.asarray(data.draw(st.lists(st.integers(0, b - 1), min_size=r, max_size=r)), np.int32)


@settings(max_examples=25, deadline=None)
@given(scores=scores_st, data=st.data(), gamma=st.sampled_from([0.0, 0.01, 0.3]))
def test_q_on_simplex_with_floor(scores, data, gamma):
    b = len(scores)
    bins = draw_bins(data, b)
    cfg = gdro.PromptGDROConfig(gamma=gamma)
    s = gdro.prompt_gdro_init(cfg, b).replace(score=jnp.asarray(scores, jnp.float32))
    q = np.asarray(gdro.prompt_gdro_q(cfg, s, jnp.asarray(bins)))
    present = np.bincount(bins, minlength=b) > 0
    assert q.sum() == pytest.approx(1.0, abs=1e-5)
    assert np.all(q[~present] == 0)
    assert np.all(q[present] >= gamma / present.sum() - 1e-7)


@settings(max_examples=25, deadline=None)
@given(scores=scores_st, data=st.data())
def test_weights_mean_one_before_cap_and_capped(scores, data):
    b = len(scores)
    bins = jnp.asarray(draw_bins(data, b))
    s = gdro.prompt_gdro_init(gdro.PromptGDROConfig(), b).replace(
        score=jnp.asarray(scores, jnp.float32)
    )
    uncapped = gdro.prompt_gdro_weights(gdro.PromptGDROConfig(weight_cap=1e30), s, bins)
    assert float(jnp.mean(uncapped)) == pytest.approx(1.0, rel=1e-4)
    w = gdro.prompt_gdro_weights(gdro.PromptGDROConfig(), s, bins)
    assert float(jnp.max(w)) <= 15.0
    np.testing.assert_allclose(w, np.minimum(uncapped, 15.0), rtol=1e-6)


def test_cap_binds_for_a_rare_heavy_bin():
    s = gdro.prompt_gdro_init(gdro.PromptGDROConfig(), 2).replace(score=jnp.array([10.0, 0.0]))
    bins = jnp.asarray([0] + [1] * 99)
    w = gdro.prompt_gdro_weights(gdro.PromptGDROConfig(), s, bins)
    assert float(w[0]) == 15.0 and float(w[1]) < 1.0


def test_invalid_rows_get_zero_weight_and_are_ignored():
    cfg = gdro.PromptGDROConfig()
    s = gdro.prompt_gdro_init(cfg, 3).replace(score=jnp.array([1.0, 0.0, 3.0]))
    bins = jnp.array([0, 1, 1, 2])
    valid = jnp.array([True, True, True, False])
    w = gdro.prompt_gdro_weights(cfg, s, bins, valid)
    assert float(w[3]) == 0.0
    np.testing.assert_allclose(w[:3], gdro.prompt_gdro_weights(cfg, s, bins[:3]), rtol=1e-6)
    s2, _ = gdro.prompt_gdro_update(
        cfg, gdro.prompt_gdro_init(cfg, 3), bins, jnp.array([1.0, 1.0, 1.0, 99.0]), valid
    )
    assert not bool(s2.seen[2]) and float(s2.score[2]) == 0.0


def test_resample_mode_weights_are_one():
    cfg = gdro.PromptGDROConfig(apply="resample")
    s = gdro.prompt_gdro_init(cfg, 3).replace(score=jnp.array([5.0, 0.0, 1.0]))
    np.testing.assert_array_equal(gdro.prompt_gdro_weights(cfg, s, jnp.array([0, 1, 2, 2])), 1.0)


def test_paper_more_prompts_in_a_bin_never_raise_its_score_or_weight():
    cfg = PAPER
    out = {}
    for n0 in (2, 4, 8):
        bins = jnp.asarray([0] * n0 + [1] * 6 + [2] * 4)
        losses = jnp.asarray([1.0] * n0 + [0.5] * 6 + [0.2] * 4)  # same per-rollout losses
        s, _ = gdro.prompt_gdro_update(cfg, gdro.prompt_gdro_init(cfg, 3), bins, losses)
        w = gdro.prompt_gdro_weights(cfg, s, bins)
        out[n0] = (float(s.score[0]), float(w[0]))
    assert out[2][0] > out[4][0] > out[8][0]
    assert out[2][1] > out[4][1] > out[8][1]


def test_signal_is_a_mean_not_a_sum():
    # Doubling every bin's rollouts with the same losses leaves the scores unchanged.
    cfg = gdro.PromptGDROConfig()
    s1, _ = gdro.prompt_gdro_update(
        cfg, gdro.prompt_gdro_init(cfg, 3), jnp.asarray(BINS), jnp.asarray(LOSS)
    )
    s2, _ = gdro.prompt_gdro_update(
        cfg,
        gdro.prompt_gdro_init(cfg, 3),
        jnp.asarray(np.tile(BINS, 2)),
        jnp.asarray(np.tile(LOSS, 2)),
    )
    np.testing.assert_allclose(s1.score, s2.score, rtol=1e-6)


def test_loss_signal_selection():
    per_rollout = jnp.array([0.1, -0.2])
    correct = jnp.array([True, False])
    surrogate = gdro.PromptGDROConfig(signal="surrogate_loss")
    np.testing.assert_allclose(
        gdro.loss_signal(surrogate, per_rollout_loss=per_rollout), per_rollout
    )
    np.testing.assert_array_equal(
        gdro.loss_signal(gdro.PromptGDROConfig(), correct=correct), [0.0, 1.0]
    )
    with pytest.raises(ValueError, match="per_rollout_loss"):
        gdro.loss_signal(surrogate, correct=correct)
    with pytest.raises(ValueError, match="correct"):
        gdro.loss_signal(gdro.PromptGDROConfig(signal="failure_rate"), per_rollout_loss=per_rollout)


def test_weights_multiply_advantages_only_not_kl():
    rng = np.random.default_rng(0)
    r, t = 6, 5
    lp = jnp.asarray(rng.normal(-1, 0.3, (r, t)), jnp.float32)
    old = lp + jnp.asarray(rng.normal(0, 0.05, (r, t)), jnp.float32)
    ref = lp + jnp.asarray(rng.normal(0, 0.2, (r, t)), jnp.float32)
    mask = jnp.ones((r, t), bool)
    adv = jnp.asarray(rng.normal(size=r), jnp.float32)
    s = gdro.prompt_gdro_init(gdro.PromptGDROConfig(), 3).replace(score=jnp.array([2.0, 0.0, 1.0]))
    w = gdro.prompt_gdro_weights(gdro.PromptGDROConfig(), s, jnp.array([0, 0, 1, 1, 2, 2]))
    assert not np.allclose(w, 1.0)
    kw = dict(ref_logprobs=ref, kl_coef=0.1)
    # KL-only loss (zero advantages): the weights change nothing.
    l0, _ = pl(lp, old, jnp.zeros(r), mask, **kw)
    l0w, _ = pl(lp, old, jnp.zeros(r), mask, sample_weights=w, **kw)
    assert float(l0w) == pytest.approx(float(l0), rel=1e-6)
    # Weighted loss == loss with pre-multiplied advantages (weights act on advantages only).
    lw, aux_w = pl(lp, old, adv, mask, sample_weights=w, **kw)
    lm, _ = pl(lp, old, adv * w, mask, **kw)
    assert float(lw) == pytest.approx(float(lm), rel=1e-5)
    # The loss signal stays computed with the unweighted advantages.
    _, aux = pl(lp, old, adv, mask, **kw)
    np.testing.assert_allclose(aux_w["per_rollout_loss"], aux["per_rollout_loss"], rtol=1e-6)


# ----------------------------------------------------------------------------- resample


def test_sample_prompts_by_bin_frequencies_and_uniform_within_bin():
    dataset_bins = jnp.asarray([0, 0, 1, 3, 3, 3, 3, 2], jnp.int32)  # bin 4 empty
    q = jnp.asarray([0.5, 0.1, 0.0, 0.2, 0.2])  # bin 4's mass renormalised
    ids = np.asarray(gdro.sample_prompts_by_bin(q, dataset_bins, jax.random.key(0), 40000))
    assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < 8
    counts = np.bincount(ids, minlength=8) / ids.size
    per_bin = np.bincount(np.asarray(dataset_bins)[ids], minlength=5)
    np.testing.assert_allclose(per_bin / ids.size, [0.625, 0.125, 0.0, 0.25, 0.0], atol=0.01)
    np.testing.assert_allclose(counts[[0, 1]], 0.3125, atol=0.01)  # uniform within bin 0
    np.testing.assert_allclose(counts[3:7], 0.0625, atol=0.006)  # uniform within bin 3
    assert counts[7] == 0.0  # bin 2 has q = 0


def test_sample_prompts_by_bin_with_q_from_state_is_jittable():
    cfg = gdro.PromptGDROConfig(apply="resample")
    s = gdro.prompt_gdro_init(cfg, 4).replace(score=jnp.array([3.0, 0.0, 0.0, 0.0]))
    all_bins = jnp.asarray([0, 1, 1, 2, 2, 2], jnp.int32)  # bin 3 empty

    @jax.jit
    def draw(key):
        q = gdro.prompt_gdro_q(cfg, s, all_bins)
        return gdro.sample_prompts_by_bin(q, all_bins, key, 4000)

    ids = np.asarray(draw(jax.random.key(1)))
    q = np.asarray(gdro.prompt_gdro_q(cfg, s, all_bins))
    assert q[3] == 0.0
    np.testing.assert_allclose(
        np.bincount(np.asarray(all_bins)[ids], minlength=4) / 4000, q, atol=0.03
    )


# ----------------------------------------------------------------------------- diagnostics


def test_diagnostics_hand_values():
    bins = np.array([0, 3, 3, 9])
    q = np.array([0.5, 0, 0, 0.25, 0, 0, 0, 0, 0, 0.25])
    d = gdro.prompt_gdro_diagnostics(
        10, bins, q=q, score=np.zeros(10), rewards=np.array([1.0, 0.0, 1.0, 1.0])
    )
    share = np.array([0.25, 0, 0, 0.5, 0, 0, 0, 0, 0, 0.25])
    np.testing.assert_allclose(d["gdro/bin_share"], share)
    assert d["gdro/mean_bin"] == pytest.approx(0.5 * 3 + 0.25 * 9)
    assert d["gdro/mass_ge3"] == pytest.approx(0.75)
    assert d["gdro/mass_ge8"] == pytest.approx(0.25)
    assert d["gdro/entropy_share"] == pytest.approx(
        -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5))
    )
    assert d["gdro/entropy_q"] == pytest.approx(d["gdro/entropy_share"])
    assert d["gdro/lead_lag"] == pytest.approx((0.25 * 3 + 0.25 * 9) - (0.5 * 3 + 0.25 * 9))
    assert d["gdro/bin_reward"][3] == pytest.approx(0.5) and np.isnan(d["gdro/bin_reward"][1])
    assert isinstance(d["gdro/q"], np.ndarray) and isinstance(d["gdro/mean_bin"], float)


# ----------------------------------------------------------------------------- state and config


def test_state_orbax_roundtrip_is_bit_exact(tmp_path):
    cfg = gdro.PromptGDROConfig()
    s = gdro.prompt_gdro_init(cfg, 10)
    rng = np.random.default_rng(1)
    for _ in range(3):
        s, _ = gdro.prompt_gdro_update(
            cfg,
            s,
            jnp.asarray(rng.integers(0, 10, 32)),
            jnp.asarray(rng.normal(size=32), jnp.float32),
        )
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", s)
    ckptr.wait_until_finished()
    r = ckptr.restore(tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, s))
    assert isinstance(r, gdro.PromptGDROState)
    for x, y in zip(jax.tree.leaves(s), jax.tree.leaves(r)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(eta=-0.1), "eta"),
        (dict(gamma=1.5), "gamma"),
        (dict(beta=0.0), "beta"),
        (dict(share_floor=0.0), "share_floor"),
        (dict(weight_cap=0.5), "weight_cap"),
        (dict(apply="sum"), "apply"),
        (dict(signal="reward"), "signal"),
        (dict(score_clip=-1.0), "score_clip"),
        (dict(mode="patch"), "mode"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        gdro.PromptGDROConfig(**kwargs)


def test_config_defaults_and_configdict():
    c = gdro.PromptGDROConfig()
    assert (c.eta, c.gamma, c.beta, c.weight_cap, c.share_floor) == (0.65, 0.01, 0.12, 15.0, 1e-3)
    assert (c.apply, c.signal, c.score_clip) == ("advantage_weight", "failure_rate", 0.0)
    assert (c.share_division, c.renormalise_informative, c.mode) == (False, True, "corrected")
    section = ml_collections.ConfigDict(dict(eta=0.5, apply="resample"))
    assert gdro.PromptGDROConfig(**section) == gdro.PromptGDROConfig.from_dict(section)
    hash(c)


# ----------------------------------------------------------------------------- corrected default


def test_corrected_hand_computed_scores_and_informative_weights():
    cfg = gdro.PromptGDROConfig(gamma=0.0)
    s = gdro.prompt_gdro_init(cfg, 3)
    # No Eq. 12 division: the first observation sets S to the bin means 2, 0.5, 0.
    s, _ = gdro.prompt_gdro_update(cfg, s, jnp.asarray(BINS), jnp.asarray(LOSS))
    np.testing.assert_allclose(s.score, [2.0, 0.5, 0.0], rtol=1e-6)
    e = np.exp(0.65 * np.array([2.0, 0.5, 0.0]))
    q = e / e.sum()
    # Rollouts 2, 3 (bin 1) and 6, 7 (bin 2) have zero advantage: the weights have mean 1 over
    # the informative rollouts 0, 1, 4, 5 = bins 0, 0, 1, 1.
    adv = jnp.asarray([1.0, -1.0, 0.0, 0.0, 0.5, -0.5, 0.0, 0.0])
    w = np.asarray(gdro.prompt_gdro_weights(cfg, s, jnp.asarray(BINS), advantages=adv))
    scale = 4 / (2 * q[0] + 2 * q[1])
    np.testing.assert_allclose(w, q[BINS] * scale, rtol=1e-5)
    assert w[[0, 1, 4, 5]].mean() == pytest.approx(1.0, rel=1e-6)
    informative = np.asarray(adv) != 0
    np.testing.assert_array_equal(
        gdro.prompt_gdro_weights(cfg, s, jnp.asarray(BINS), informative=jnp.asarray(informative)),
        w,
    )
    # Paper normalisation (all rollouts) differs on the same input.
    paper_w = gdro.prompt_gdro_weights(
        gdro.PromptGDROConfig(gamma=0.0, renormalise_informative=False), s, jnp.asarray(BINS)
    )
    np.testing.assert_allclose(paper_w, q[BINS] * 8 / q[BINS].sum(), rtol=1e-5)
    assert not np.allclose(paper_w, w)


def test_corrected_score_does_not_depend_on_bin_counts():
    cfg = gdro.PromptGDROConfig()
    scores = []
    for n0 in (1, 2, 8):
        bins = jnp.asarray([0] * n0 + [1] * 6)
        losses = jnp.asarray([1.0] * n0 + [0.5] * 6)
        s, _ = gdro.prompt_gdro_update(cfg, gdro.prompt_gdro_init(cfg, 2), bins, losses)
        scores.append(np.asarray(s.score))
    np.testing.assert_allclose(scores, [[1.0, 0.5]] * 3, rtol=1e-6)


def test_share_floor_is_a_live_field():
    # Paper division: bin 0 holds 1 of 100 rollouts (share 0.01); floor 0.05 bounds the division.
    bins = jnp.asarray([0] + [1] * 99)
    losses = jnp.ones(100)
    got = {}
    for floor in (1e-3, 0.05):
        cfg = gdro.PromptGDROConfig(mode="paper", share_floor=floor)
        s, _ = gdro.prompt_gdro_update(cfg, gdro.prompt_gdro_init(cfg, 2), bins, losses)
        got[floor] = np.asarray(s.score)
    np.testing.assert_allclose(got[1e-3], [100.0, 100 / 99], rtol=1e-5)
    np.testing.assert_allclose(got[0.05], [20.0, 100 / 99], rtol=1e-5)


def test_unseen_rollouts_weight_one_and_no_score():
    cfg = gdro.PromptGDROConfig(gamma=0.0)
    s = gdro.prompt_gdro_init(cfg, 2).replace(
        score=jnp.array([1.0, 0.0]), seen=jnp.array([True, True])
    )
    bins = jnp.asarray([0, 0, 1, 1, 2, 2])  # 2 = B: unseen prompts
    adv = jnp.asarray([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    w = np.asarray(gdro.prompt_gdro_weights(cfg, s, bins, advantages=adv))
    e = np.exp(0.65)
    np.testing.assert_allclose(w, [2 * e / (e + 1)] * 2 + [2 / (e + 1)] * 2 + [1.0, 1.0], rtol=1e-5)
    assert w.mean() == pytest.approx(1.0, rel=1e-6)
    s2, d = gdro.prompt_gdro_update(cfg, s, bins, jnp.asarray([0.0, 0, 1, 1, 50, 50]))
    np.testing.assert_allclose(s2.score, [0.88 * 1.0, 0.12 * 1.0], rtol=1e-6)
    assert d["gdro/unseen_share"] == pytest.approx(1 / 3)
    np.testing.assert_allclose(d["gdro/bin_share"], [0.5, 0.5])


def test_weight_diagnostics_hand_values():
    d = gdro.weight_diagnostics(
        np.array([1.0, 3.0, 7.0]), np.array([True, True, False]), weight_cap=3.0
    )
    assert d["gdro/weight_ess"] == pytest.approx(16 / 20)  # (1 + 3)^2 / (2 (1 + 9))
    assert d["gdro/weight_cap_bound"] == 1 and d["gdro/weight_capped_fraction"] == 0.5
    d = gdro.weight_diagnostics(np.ones(4), weight_cap=15.0)
    assert d["gdro/weight_ess"] == 1.0 and d["gdro/weight_cap_bound"] == 0
    # From the update: the weights of this step (pre-update state), over informative rollouts.
    cfg = gdro.PromptGDROConfig()
    s = gdro.prompt_gdro_init(cfg, 2).replace(score=jnp.array([10.0, 0.0]))
    bins = jnp.asarray([0] + [1] * 99)
    adv = jnp.ones(100)
    w = np.asarray(gdro.prompt_gdro_weights(cfg, s, bins, advantages=adv))
    _, d = gdro.prompt_gdro_update(cfg, s, bins, jnp.zeros(100), advantages=adv)
    assert d["gdro/weight_cap_bound"] == 1 and w[0] == 15.0
    assert d["gdro/weight_ess"] == pytest.approx(w.sum() ** 2 / (100 * (w**2).sum()), rel=1e-5)


@settings(max_examples=25, deadline=None)
@given(scores=scores_st, data=st.data())
def test_informative_weights_mean_one_before_cap_and_ess_in_unit_interval(scores, data):
    b = len(scores)
    bins = draw_bins(data, b)
    r = len(bins)
    bins = np.where(np.asarray(data.draw(st.lists(st.booleans(), min_size=r, max_size=r))), b, bins)
    inf = np.asarray(data.draw(st.lists(st.booleans(), min_size=r, max_size=r)))
    s = gdro.prompt_gdro_init(gdro.PromptGDROConfig(), b).replace(
        score=jnp.asarray(scores, jnp.float32)
    )
    uncapped = np.asarray(
        gdro.prompt_gdro_weights(
            gdro.PromptGDROConfig(weight_cap=1e30), s, jnp.asarray(bins), informative=inf
        )
    )
    seen = bins < b
    np.testing.assert_array_equal(uncapped[~seen], 1.0)  # unseen: weight 1
    assert np.all(uncapped >= 0)
    if np.any(inf & seen):
        assert uncapped[inf].mean() == pytest.approx(1.0, rel=1e-4)
    cfg = gdro.PromptGDROConfig()
    q = np.asarray(gdro.prompt_gdro_q(cfg, s, jnp.asarray(np.where(seen, bins, 0)), seen))
    if seen.any():
        assert q.sum() == pytest.approx(1.0, abs=1e-5)
    d = gdro.prompt_gdro_weight_diagnostics(cfg, s, jnp.asarray(bins), informative=inf)
    if inf.any():
        assert 0.0 < d["gdro/weight_ess"] <= 1.0 + 1e-9


def test_resample_q_keeps_unseen_prompts_drawable():
    cfg = gdro.PromptGDROConfig(apply="resample", gamma=0.0, population_weighted=False)
    s = gdro.prompt_gdro_init(cfg, 2).replace(score=jnp.array([1.0, 0.0]))
    all_bins = jnp.asarray([0, 1, 2, 2], jnp.int32)  # half the pool unseen (marker 2)
    q = np.asarray(gdro.resample_q(cfg, s, all_bins))
    e = math.exp(0.65)
    np.testing.assert_allclose(q, [0.5 * e / (e + 1), 0.5 / (e + 1), 0.5], rtol=1e-6)
    ids = np.asarray(gdro.sample_prompts_by_bin(q, all_bins, jax.random.key(0), 20000))
    np.testing.assert_allclose(np.mean(ids >= 2), 0.5, atol=0.02)
    # All unseen: uniform draw. No unseen: prompt_gdro_q with a 0 appended.
    q = np.asarray(gdro.resample_q(cfg, s, jnp.full((4,), 2, jnp.int32)))
    np.testing.assert_allclose(q, [0.0, 0.0, 1.0])
    seen_bins = jnp.asarray([0, 1, 1], jnp.int32)
    np.testing.assert_array_equal(
        gdro.resample_q(cfg, s, seen_bins)[:2], gdro.prompt_gdro_q(cfg, s, seen_bins)
    )


# ----------------------------------------------------------------------------- acting controllers


@given(st.integers(0, 10_000), st.sampled_from(["corrected", "paper"]))
@settings(max_examples=30, deadline=None)
def test_step_size_zero_gives_unit_weights_exactly(seed, mode):
    rng = np.random.default_rng(seed)
    cfg = gdro.PromptGDROConfig(eta=0.0, mode=mode)
    s = gdro.prompt_gdro_init(cfg, 4).replace(
        score=jnp.asarray(rng.normal(size=4), jnp.float32), seen=jnp.ones(4, bool)
    )
    bins = jnp.asarray(rng.integers(0, 5 if mode == "corrected" else 4, 32), jnp.int32)
    adv = jnp.asarray(rng.normal(size=32) * (rng.uniform(size=32) > 0.3), jnp.float32)
    w = np.asarray(gdro.prompt_gdro_weights(cfg, s, bins, advantages=adv))
    np.testing.assert_array_equal(w, np.ones(32, np.float32))


def test_population_weighted_resample_q_by_hand():
    cfg = gdro.PromptGDROConfig(apply="resample", gamma=0.0, eta=1.0)
    s = gdro.prompt_gdro_init(cfg, 2).replace(score=jnp.array([1.0, 0.0]))
    # bin 0: 1 prompt, bin 1: 3 prompts, 2 unseen (marker 2); q = (e, 1) / (e + 1)
    all_bins = jnp.asarray([0, 1, 1, 1, 2, 2], jnp.int32)
    p = np.asarray(gdro.resample_q(cfg, s, all_bins))
    e = math.e
    # per-prompt weights u_b = q_b * 4 / (1 q_0 + 3 q_1): u_0 = 4e / (e + 3), u_1 = 4 / (e + 3)
    u0, u1 = 4 * e / (e + 3), 4 / (e + 3)
    np.testing.assert_allclose(p, [u0 / 6, 3 * u1 / 6, 2 / 6], rtol=1e-6)
    # a prompt is drawn with probability proportional to its bin's weight, unseen ones weigh 1
    ids = np.asarray(gdro.sample_prompts_by_bin(p, all_bins, jax.random.key(1), 60000))
    freq = np.bincount(ids, minlength=6) / ids.size
    np.testing.assert_allclose(freq, np.array([u0, u1, u1, u1, 1, 1]) / 6, atol=0.01)
    # eta = 0: every prompt alike (the uniform sampler)
    flat = gdro.PromptGDROConfig(apply="resample", eta=0.0)
    np.testing.assert_allclose(gdro.resample_q(flat, s, all_bins), [1 / 6, 3 / 6, 2 / 6], rtol=1e-6)


def test_weight_ratio_and_informative_signal_by_hand():
    d = gdro.weight_diagnostics(
        np.array([2.0, 0.5, 1.0, 9.0]), np.array([True, True, True, False]), weight_cap=15
    )
    assert d["gdro/weight_ratio"] == pytest.approx(4.0)  # max / min over informative rollouts
    assert d["gdro/weight_max"] == 9.0
    assert np.isnan(gdro.weight_diagnostics(np.ones(3), np.zeros(3, bool))["gdro/weight_ratio"])
    cfg = gdro.PromptGDROConfig(signal="informative")
    sig = gdro.loss_signal(cfg, correct=jnp.ones(4, bool), advantages=jnp.array([0.0, 1, -1, 0]))
    np.testing.assert_array_equal(sig, [0, 1, 1, 0])
    with pytest.raises(ValueError, match="advantages"):
        gdro.loss_signal(cfg, correct=jnp.ones(4, bool))
