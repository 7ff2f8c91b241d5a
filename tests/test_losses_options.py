"""Tests for the policy-loss options: GSPO sequence ratio, CISPO, SAPO, TIS, ratio-corrected KL,
overlong filtering. Expected values are derived by hand in the comments (or with numpy from the
papers' formulas), never from the implementation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_losses import pl

from grpo_jax import losses

MODES = losses.LOSS_AGG_MODES
F32 = jnp.float32
NAN = np.nan

PL = jax.jit(
    pl,
    static_argnames=(
        "loss_agg_mode",
        "ratio_level",
        "kl_kind",
        "max_len",
        "dual_clip",
        "policy_loss_type",
        "cispo_epsilon_low",
        "kl_ratio_correction",
    ),
)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def one_token_rows(ratios, advantages, old=-1.0):
    """Rows of one token each with `rho = ratios` and `logprobs = old + log(rho)`."""
    old_lp = jnp.full((len(ratios), 1), old, F32)
    lp = old_lp + jnp.log(jnp.asarray(ratios, F32))[:, None]
    return lp, old_lp, jnp.asarray(advantages, F32), jnp.ones((len(ratios), 1))


def loss_and_grad(lp, *args, **kw):
    return jax.value_and_grad(lambda x: PL(x, *args, **kw), has_aux=True)(lp)


# ================================================================ sequence-level ratio (GSPO)


def test_sequence_ratio_gradient_hand_values():
    """GSPO Eq. 7: s = exp(mean_t (lp_t - old_t)); d s / d lp_t = s / n."""
    lp = jnp.array([[0.1, 0.3, NAN]])
    old = jnp.zeros((1, 3))
    m = jnp.array([[1, 1, 0]])
    a = jnp.array([1.0])
    # s = exp(0.2) = 1.2214 < 1.3: unclipped; loss = token mean of -s = -s; grad = -s / 2 each
    (loss, _), g = loss_and_grad(lp, old, a, m, ratio_level="sequence", epsilon_high=0.3)
    s = math.exp(0.2)
    np.testing.assert_allclose(loss, -s, rtol=1e-6)
    np.testing.assert_allclose(g, [[-s / 2, -s / 2, 0.0]], rtol=1e-6)
    # token level: token 0 (rho = e^.1) unclipped, token 1 (rho = e^.3 = 1.35 > 1.3) clipped
    (loss, _), g = loss_and_grad(lp, old, a, m, epsilon_high=0.3)
    np.testing.assert_allclose(loss, (-math.exp(0.1) - 1.3) / 2, rtol=1e-6)
    np.testing.assert_allclose(g, [[-math.exp(0.1) / 2, 0.0, 0.0]], rtol=1e-6)
    # sequence level with epsilon_high = 0.2: s > 1.2, the whole row is clipped (no gradient)
    (loss, aux), g = loss_and_grad(lp, old, a, m, ratio_level="sequence", epsilon_high=0.2)
    np.testing.assert_allclose(loss, -1.2, rtol=1e-6)
    np.testing.assert_array_equal(g, 0.0)
    assert float(aux["clip_fraction"]) == 1.0


def test_sequence_ratio_rows_are_independent_and_seq_mean_is_gspo():
    """Two rows of different lengths: GSPO's objective mean_r min(s_r A_r, clip(s_r) A_r) is
    `seq-mean-token-mean`; each row's ratio only sees its own tokens."""
    lp = jnp.array([[0.1, -0.1, 0.3], [-0.2, NAN, NAN]])
    old = jnp.zeros((2, 3))
    m = jnp.array([[1, 1, 1], [1, 0, 0]])
    a = jnp.array([1.0, -2.0])
    s0, s1 = math.exp(0.1), math.exp(-0.2)  # means 0.3/3 and -0.2; both inside [0.8, 1.2]
    loss, aux = PL(lp, old, a, m, ratio_level="sequence", loss_agg_mode="seq-mean-token-mean")
    np.testing.assert_allclose(loss, (-s0 + 2 * s1) / 2, rtol=1e-6)
    np.testing.assert_allclose(aux["per_rollout_loss"], [-s0, 2 * s1], rtol=1e-6)
    np.testing.assert_allclose(aux["ratio_mean"], (3 * s0 + s1) / 4, rtol=1e-6)


# ================================================================ CISPO


def test_cispo_hand_values_and_gradient():
    # old = -1, so logprobs = -1 + log(rho) (differs from the log-ratio: the loss uses logprobs)
    rho = [0.5, 1.5, 1.5, 1.1]
    a = [1.0, 1.0, -1.0, 2.0]
    lp, old, adv, m = one_token_rows(rho, a)
    (loss, aux), g = loss_and_grad(lp, old, adv, m, policy_loss_type="cispo")
    # weights sg(clip(rho, -inf, 1.28)) = [0.5, 1.28, 1.28, 1.1]
    w = np.array([0.5, 1.28, 1.28, 1.1])
    logp = -1.0 + np.log(rho)
    per_row = -w * np.array(a) * logp
    np.testing.assert_allclose(aux["per_rollout_loss"], per_row, rtol=1e-6)
    np.testing.assert_allclose(loss, per_row.mean(), rtol=1e-6)
    # d/d logprobs of -sg(w) A logp = -w A, divided by the 4 tokens of token-mean
    np.testing.assert_allclose(g[:, 0], -w * np.array(a) / 4, rtol=1e-6)
    np.testing.assert_allclose(aux["clip_fraction"], 0.5)  # both rho = 1.5 rows (either sign)
    # a lower bound: rho = 0.5 -> weight 0.8 (clipped too)
    (loss, aux), g = loss_and_grad(
        lp, old, adv, m, policy_loss_type="cispo", cispo_epsilon_low=0.2, cispo_epsilon_high=0.3
    )
    w = np.array([0.8, 1.3, 1.3, 1.1])
    np.testing.assert_allclose(loss, np.mean(-w * np.array(a) * logp), rtol=1e-6)
    np.testing.assert_allclose(g[:, 0], -w * np.array(a) / 4, rtol=1e-6)
    np.testing.assert_allclose(aux["clip_fraction"], 0.75)


def test_cispo_keeps_gradient_where_clip_drops_it():
    """rho = 1.5, A > 0: the PPO clip gives zero gradient, CISPO the weight 1 + eps_high."""
    lp, old, adv, m = one_token_rows([1.5], [1.0])
    _, g_clip = loss_and_grad(lp, old, adv, m)
    _, g_cispo = loss_and_grad(lp, old, adv, m, policy_loss_type="cispo")
    assert float(g_clip[0, 0]) == 0.0
    np.testing.assert_allclose(g_cispo[0, 0], -1.28, rtol=1e-6)


# ================================================================ SAPO


def test_sapo_hand_values_and_gradient():
    """SAPO gate f(x) = sigmoid(tau (x - 1)) 4 / tau, L = -f(rho) A;
    dL/dlogp = -A 4 sigmoid(.) (1 - sigmoid(.)) rho."""
    rho = [1.5, 0.5, 1.0, 1.0, 3.0]
    a = [1.0, -1.0, 2.0, -1.0, -0.5]
    lp, old, adv, m = one_token_rows(rho, a)
    (loss, aux), g = loss_and_grad(lp, old, adv, m, policy_loss_type="sapo")
    per_row, grad = [], []
    for r, ai in zip(rho, a):
        tau = 1.0 if ai > 0 else 1.05
        s = sigmoid(tau * (r - 1.0))
        per_row.append(-ai * s * 4 / tau)
        grad.append(-ai * 4 * s * (1 - s) * r / len(rho))
    np.testing.assert_allclose(aux["per_rollout_loss"], per_row, rtol=1e-6)
    np.testing.assert_allclose(loss, np.mean(per_row), rtol=1e-6)
    np.testing.assert_allclose(g[:, 0], grad, rtol=1e-5)
    # closed forms at rho = 1: f(1) = 2 / tau and the gradient weight is exactly 1
    np.testing.assert_allclose(per_row[2:4], [-2 * 2.0, 2 / 1.05], rtol=1e-12)
    np.testing.assert_allclose(g[2:4, 0], [-2.0 / 5, 1.0 / 5], rtol=1e-6)
    assert float(aux["clip_fraction"]) == 0.0
    # the temperatures are parameters: tau_pos = 2 at rho = 1.5, A = 1: -sigmoid(1) * 2
    loss, _ = PL(lp[:1], old[:1], adv[:1], m[:1], policy_loss_type="sapo", sapo_tau_pos=2.0)
    np.testing.assert_allclose(loss, -sigmoid(1.0) * 2.0, rtol=1e-6)
    loss, _ = PL(lp[1:2], old[1:2], adv[1:2], m[1:2], policy_loss_type="sapo", sapo_tau_neg=3.0)
    np.testing.assert_allclose(loss, sigmoid(-1.5) * 4 / 3, rtol=1e-6)


def test_sapo_gradient_decays_smoothly_off_policy():
    """No hard cut-off: d L / d logp = -A rho w(rho) with the SAPO weight
    w = 4 s (1 - s) = sech^2(tau (rho - 1) / 2) (s = sigmoid(tau (rho - 1))): positive
    everywhere, 1 at rho = 1, decaying on both sides (A > 0, tau = 1)."""
    rho = np.array([0.25, 0.5, 1.0, 2.0, 8.0])
    lp, old, adv, m = one_token_rows(rho, [1.0] * 5)
    _, g = loss_and_grad(
        lp, old, adv, m, policy_loss_type="sapo", loss_agg_mode="seq-mean-token-sum"
    )
    w = -np.asarray(g[:, 0]) * 5 / rho  # undo the mean over 5 rows and the factor rho
    np.testing.assert_allclose(w, 1 / np.cosh((rho - 1) / 2) ** 2, rtol=1e-4)  # f32 1 - s
    assert np.all(w > 0) and w[2] == pytest.approx(1.0, rel=1e-6)
    assert w[4] < w[3] < 1.0 and w[0] < w[1] < 1.0


# ================================================================ truncated importance sampling


def test_tis_hand_values():
    """rho = 1 (old = logprobs); raw weights exp(old - sampler) = [3, 0.5], cap 2."""
    lp = jnp.array([[-1.0], [-2.0]])
    sampler = lp - jnp.log(jnp.array([[3.0], [0.5]]))
    a = jnp.array([1.0, -2.0])
    m = jnp.ones((2, 1))
    (loss, aux), g = loss_and_grad(lp, lp, a, m, sampler_logprobs=sampler, tis_cap=2.0)
    # per token -A w = [-1 * 2, 2 * 0.5] = [-2, 1]; token-mean -0.5; grad -A w / 2
    np.testing.assert_allclose(loss, -0.5, rtol=1e-6)
    np.testing.assert_allclose(aux["per_rollout_loss"], [-2.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(g[:, 0], [-1.0, 0.5], rtol=1e-6)
    np.testing.assert_allclose(aux["tis_weight_mean"], 1.25, rtol=1e-6)
    np.testing.assert_allclose(aux["tis_clip_fraction"], 0.5)
    # the KL term is not TIS-weighted: loss - pg_loss = kl_coef * KL (k1 = -(ref - lp) = 0.5)
    ref = lp - 0.5
    loss, aux = PL(
        lp,
        lp,
        a,
        m,
        sampler_logprobs=sampler,
        tis_cap=2.0,
        ref_logprobs=ref,
        kl_coef=0.1,
        kl_kind="k1",
    )
    np.testing.assert_allclose(loss, -0.5 + 0.1 * 0.5, rtol=1e-6)
    np.testing.assert_allclose(aux["pg_loss"], -0.5, rtol=1e-6)


@pytest.mark.parametrize("policy_loss_type", ("clip", "cispo", "sapo"))
def test_tis_multiplies_every_loss_type(policy_loss_type):
    """The TIS weight multiplies the per-token policy-gradient term (values and gradients)."""
    rng = np.random.default_rng(3)
    lp = jnp.asarray(-np.abs(rng.normal(size=(3, 4))), F32)
    old = lp + jnp.asarray(0.2 * rng.normal(size=(3, 4)), F32)
    sampler = old + jnp.asarray(0.5 * rng.normal(size=(3, 4)), F32)
    a = jnp.asarray([1.0, -0.5, 2.0], F32)
    m = jnp.asarray([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], F32)
    w = np.minimum(np.exp(np.asarray(old) - np.asarray(sampler)), 1.5)
    kw = dict(policy_loss_type=policy_loss_type, loss_agg_mode="seq-mean-token-sum")

    (_, aux), g = loss_and_grad(lp, old, a, m, sampler_logprobs=sampler, tis_cap=1.5, **kw)
    g_plain = jax.grad(lambda x: PL(x, old, a, m, **kw)[0])(lp)
    # seq-mean-token-sum: gradient per token = w_t * plain gradient per token
    np.testing.assert_allclose(g, w * np.asarray(g_plain), rtol=1e-5, atol=1e-7)
    assert float(aux["tis_clip_fraction"]) > 0  # the cap is exercised


# ================================================================ KL with the ratio correction


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_kl_ratio_correction_hand_values(level):
    """kl_t = rho_t k3_t with the live ratio of `ratio_level` (TRL use_bias_correction_kl):
    lp = [-1, -2], old = [-1.5, -1.8] (token log-ratios .5, -.2; sequence .15),
    ref = [-.5, -2.5] (delta = ref - lp = +.5, -.5); A = 0 so only the KL term remains."""
    lp = jnp.array([[-1.0, -2.0, NAN]])
    old = jnp.array([[-1.5, -1.8, NAN]])
    ref = jnp.array([[-0.5, -2.5, NAN]])
    m = jnp.array([[1, 1, 0]])
    d = np.array([0.5, -0.5])
    k3 = np.exp(d) - d - 1
    kw = dict(ref_logprobs=ref, kl_coef=0.1, ratio_level=level)
    (loss, aux), g = loss_and_grad(lp, old, jnp.zeros(1), m, kl_ratio_correction=True, **kw)
    if level == "token":
        rho = np.exp([0.5, -0.2])
        # d/dlp_t (rho_t k3_t) = rho_t (k3_t + 1 - e^delta_t) = -rho_t delta_t
        want_g = 0.1 * -rho * d / 2
    else:
        rho = np.exp([0.15, 0.15])
        # rho = exp(mean_t(lp_t - old_t)): d rho / d lp_j = rho / 2
        want_g = 0.1 * (rho / 2 * k3.sum() + rho * (1 - np.exp(d))) / 2
    np.testing.assert_allclose(loss, 0.1 * np.mean(rho * k3), rtol=1e-5)
    np.testing.assert_allclose(aux["kl"], np.mean(rho * k3), rtol=1e-5)
    np.testing.assert_allclose(g[0, :2], want_g, rtol=1e-5)
    assert g[0, 2] == 0
    (loss, _), g = loss_and_grad(lp, old, jnp.zeros(1), m, **kw)  # off: plain k3
    np.testing.assert_allclose(loss, 0.1 * np.mean(k3), rtol=1e-5)
    np.testing.assert_allclose(g[0, :2], 0.1 * (1 - np.exp(d)) / 2, rtol=1e-5)


def test_kl_ratio_correction_on_policy_keeps_the_value_and_adds_the_ratios_gradient():
    """old = sg(lp): rho = 1, so the loss is plain k3's; the live ratio's gradient adds k3_t, and
    the per-token gradient becomes (lp - ref) = -delta (k3's own is 1 - e^delta)."""
    lp = jnp.array([[-1.0, -2.0]])
    ref = jnp.array([[-0.5, -2.5]])
    m = jnp.ones((1, 2))
    d = np.array([0.5, -0.5])
    kw = dict(ref_logprobs=ref, kl_coef=0.1)

    def f(x, correction):
        return PL(
            x, jax.lax.stop_gradient(x), jnp.zeros(1), m, kl_ratio_correction=correction, **kw
        )[0]

    np.testing.assert_allclose(f(lp, True), f(lp, False), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(f)(lp, True)[0], 0.1 * -d / 2, rtol=1e-5)
    np.testing.assert_allclose(jax.grad(f)(lp, False)[0], 0.1 * (1 - np.exp(d)) / 2, rtol=1e-5)


# ================================================================ ratio 1 = REINFORCE, every type


def reinforce(lp, a, m, mode, max_len):
    """Independent aggregation of the REINFORCE loss -A * logprob."""
    s = jnp.sum(jnp.where(m > 0, -a[:, None] * lp, 0.0), axis=1)
    n = jnp.sum(m, axis=1)
    return {
        "token-mean": jnp.sum(s) / jnp.sum(n),
        "seq-mean-token-mean": jnp.mean(s / n),
        "seq-mean-token-sum": jnp.mean(s),
        "seq-mean-token-sum-norm": jnp.sum(s) / (lp.shape[0] * max_len),
    }[mode]


@pytest.mark.parametrize("policy_loss_type", ["cispo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ratio_one_gradient_equals_reinforce(policy_loss_type, level):
    rng = np.random.default_rng(14)
    lp = jnp.asarray(-np.abs(rng.normal(size=(3, 5))), F32)
    a = jnp.asarray(rng.normal(size=3), F32)
    m = jnp.asarray([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], F32)

    @jax.jit
    def grads(lp):
        return [
            (
                jax.grad(
                    lambda x: pl(
                        x,
                        x,
                        a,
                        m,
                        loss_agg_mode=mode,
                        ratio_level=level,
                        policy_loss_type=policy_loss_type,
                    )[0]
                )(lp),
                jax.grad(lambda x: reinforce(x, a, m, mode, 5))(lp),
            )
            for mode in MODES
        ]

    for g, g_ref in grads(lp):
        assert float(jnp.max(jnp.abs(g_ref))) > 1e-2
        np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-7)


# ================================================================ masked rows, garbage, micro-batches

# (policy_loss_type, ratio_level, TIS on, kl_ratio_correction)
CONFIGS = [
    ("cispo", "token", False, False),
    ("sapo", "token", False, False),
    ("clip", "token", True, True),
    ("cispo", "sequence", True, True),
    ("sapo", "sequence", True, True),
]
R, T = 4, 6


def make_batch(seed, lens):
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens)
    m = (np.arange(T)[None] < lens[:, None]).astype(np.float32)
    lp = -np.abs(rng.normal(size=(R, T))).astype(np.float32)
    old = (lp + 0.4 * rng.normal(size=(R, T))).astype(np.float32)
    ref = (lp + 0.4 * rng.normal(size=(R, T))).astype(np.float32)
    samp = (old + 0.4 * rng.normal(size=(R, T))).astype(np.float32)
    a = rng.normal(size=R).astype(np.float32)
    w = rng.uniform(0.2, 3.0, size=R).astype(np.float32)
    return lp, old, a, m, ref, samp, w


def _call(cfg, mode, lp, old, a, m, ref, samp, w, den=None):
    kind, level, tis, klc = cfg
    return pl(
        lp,
        old,
        a,
        m,
        loss_agg_mode=mode,
        ratio_level=level,
        policy_loss_type=kind,
        ref_logprobs=ref,
        kl_coef=0.1,
        kl_ratio_correction=klc,
        sampler_logprobs=samp if tis else None,
        tis_cap=2.0 if tis else None,
        sample_weights=w,
        max_len=8,
        denominator=den,
    )


@jax.jit
def _accumulate(lp, old, a, m, ref, samp, w):
    """Per config and mode: the full batch in one pass, and two micro-batches of R/2 rows each
    given the full batch's denominator (one compile for all)."""
    out = []
    for cfg in CONFIGS:
        for mode in MODES:

            def f(lp, old, a, m, ref, samp, w, den, cfg=cfg, mode=mode):
                return _call(cfg, mode, lp, old, a, m, ref, samp, w, den)

            vg = jax.value_and_grad(f, has_aux=True)
            den = losses.loss_denominator(m, mode, max_len=8)
            full = vg(lp, old, a, m, ref, samp, w, None)
            micro = [
                vg(*(x[s] for x in (lp, old, a, m, ref, samp, w)), den)
                for s in (slice(0, R // 2), slice(R // 2, R))
            ]
            out.append((den, full, micro))
    return out


@pytest.mark.parametrize(
    "seed,lens",
    [
        (0, [6, 3, 1, 5]),  # a full-length row (every position in)
        (1, [4, 0, 6, 2]),  # an empty row (all-zero mask)
        (2, [0, 0, 3, 6]),  # a micro-batch without any token (local denominator 0)
    ],
)
def test_microbatch_accumulation_equals_full_batch(seed, lens):
    names = [(c, md) for c in CONFIGS for md in MODES]
    results = _accumulate(*make_batch(seed, lens))
    for (cfg, mode), (den, ((full, aux_full), g_full), micro) in zip(names, results):
        ctx = f"{cfg} {mode}"
        assert np.isfinite(full), ctx
        np.testing.assert_allclose(den, aux_full["denominator"], err_msg=ctx)
        total = sum(lm for (lm, _), _ in micro)
        np.testing.assert_allclose(total, full, rtol=1e-5, atol=1e-6, err_msg=ctx)
        g_micro = np.concatenate([g for _, g in micro])
        np.testing.assert_allclose(g_micro, g_full, rtol=1e-5, atol=1e-7, err_msg=ctx)
        assert float(np.max(np.abs(g_full))) > 1e-3, ctx  # the gradient is not trivially zero
        sums = sum(aux["loss_sum"] for (_, aux), _ in micro)
        dens = sum(aux["denominator"] for (_, aux), _ in micro)
        np.testing.assert_allclose(dens, den, err_msg=ctx)
        np.testing.assert_allclose(sums / dens, full, rtol=1e-5, atol=1e-6, err_msg=ctx)


@jax.jit
def _all_configs(lp, old, a, m, ref, samp, w):
    return [
        jax.value_and_grad(lambda x, c=cfg, md=mode: _call(c, md, x, old, a, m, ref, samp, w)[0])(
            lp
        )
        for cfg in CONFIGS
        for mode in MODES
    ]


def test_empty_row_and_masked_garbage_change_nothing():
    """Row 1 is empty (all-zero mask) and holds NaN/inf everywhere; the other rows hold garbage
    past their lengths. Loss and gradient equal those of the clean batch (masked entries 0),
    masked positions get exactly zero gradient, and the empty row counts for nothing: the loss
    equals that of the batch without row 1, except for `seq-mean-token-sum-norm`, whose
    constant `R * max_len` counts every row (so loss_3_rows = 4/3 * loss_4_rows)."""
    lp, old, a, m, ref, samp, w = make_batch(5, [6, 0, 3, 5])
    masked = m == 0
    dirty = []
    for i, x in enumerate((lp, old, ref, samp)):
        x = x.copy()
        x[masked] = [NAN, np.inf, -np.inf, 1e30][i]
        dirty.append(x)
    a_d, w_d = a.copy(), w.copy()
    a_d[1], w_d[1] = NAN, np.inf
    clean = [np.where(masked, 0.0, x).astype(np.float32) for x in (lp, old, ref, samp)]
    a_c, w_c = a.copy(), w.copy()
    a_c[1], w_c[1] = 0.0, 1.0
    res_dirty = _all_configs(dirty[0], dirty[1], a_d, m, dirty[2], dirty[3], w_d)
    res_clean = _all_configs(clean[0], clean[1], a_c, m, clean[2], clean[3], w_c)
    keep = np.array([0, 2, 3])
    res_3 = _all_configs(*(x[keep] for x in (lp, old, a, m, ref, samp, w)))
    names = [(c, md) for c in CONFIGS for md in MODES]
    for (l_d, g_d), (l_c, g_c), (l_3, g_3), (cfg, mode) in zip(res_dirty, res_clean, res_3, names):
        ctx = f"{cfg} {mode}"
        assert np.isfinite(l_d) and np.all(np.isfinite(g_d)), ctx
        np.testing.assert_allclose(l_d, l_c, rtol=1e-6, atol=1e-7, err_msg=ctx)
        np.testing.assert_allclose(g_d, g_c, rtol=1e-6, atol=1e-7, err_msg=ctx)
        np.testing.assert_array_equal(np.asarray(g_d)[masked], 0.0, err_msg=ctx)
        f = 4 / 3 if mode == "seq-mean-token-sum-norm" else 1.0
        np.testing.assert_allclose(l_3, f * l_d, rtol=1e-5, atol=1e-7, err_msg=ctx)
        np.testing.assert_allclose(
            g_3, f * np.asarray(g_d)[keep], rtol=1e-5, atol=1e-7, err_msg=ctx
        )


@pytest.mark.parametrize("policy_loss_type", ("clip", "cispo", "sapo"))
def test_batch_of_empty_rows(policy_loss_type):
    """Nothing in the batch: loss 0, denominator 0, zero finite gradient, no NaN in the metrics."""
    x = jnp.full((2, 3), jnp.nan)
    m = jnp.zeros((2, 3))
    kw = dict(policy_loss_type=policy_loss_type, sampler_logprobs=x, tis_cap=2.0)
    (loss, aux), g = loss_and_grad(
        x, x, jnp.array([1.0, jnp.nan]), m, ref_logprobs=x, kl_coef=0.1, **kw
    )
    assert float(loss) == 0.0 and float(aux["denominator"]) == 0.0
    np.testing.assert_array_equal(g, 0.0)
    for k, v in aux.items():
        assert np.all(np.isfinite(np.asarray(v))), k


# ================================================================ overlong filtering


def test_overlong_filter_masks_rows_and_their_denominator():
    m = jnp.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], jnp.int32)
    truncated = jnp.array([True, False, True])
    out = losses.overlong_filter(m, truncated)
    assert out.dtype == m.dtype
    np.testing.assert_array_equal(out, [[0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(
        losses.overlong_filter(m.astype(F32), jnp.array([0, 1, 0])), [[1] * 4, [0] * 4, [1] * 4]
    )
    # denominators: token-mean 2 tokens, seq means 1 row, the Dr. GRPO constant 3 * 4 unchanged
    assert float(losses.loss_denominator(out, "token-mean")) == 2.0
    assert float(losses.loss_denominator(out, "seq-mean-token-mean")) == 1.0
    assert float(losses.loss_denominator(out, "seq-mean-token-sum")) == 1.0
    assert float(losses.loss_denominator(out, "seq-mean-token-sum-norm")) == 12.0
    # the loss of the filtered batch is the loss of row 1 alone: ratio 1, A = -3, L_t = 3
    lp = jnp.array([[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.6, NAN, NAN], [-1.0, -1.0, -1.0, -1.0]])
    a = jnp.array([5.0, -3.0, 7.0])
    for mode, expect in [
        ("token-mean", 3.0),
        ("seq-mean-token-mean", 3.0),
        ("seq-mean-token-sum", 6.0),
        ("seq-mean-token-sum-norm", 6.0 / 12.0),
    ]:
        loss, _ = PL(lp, lp, a, out, loss_agg_mode=mode)
        np.testing.assert_allclose(loss, expect, rtol=1e-6, err_msg=mode)
    with pytest.raises(AssertionError):
        losses.overlong_filter(m, jnp.array([True, False]))


# ================================================================ argument checks


def test_new_argument_errors():
    lp, m, a = jnp.zeros((2, 3)), jnp.ones((2, 3)), jnp.zeros(2)
    bad = [
        dict(policy_loss_type="ppo"),
        dict(policy_loss_type="cispo", dual_clip=3.0),
        dict(policy_loss_type="sapo", dual_clip=3.0),
        dict(policy_loss_type="cispo", cispo_epsilon_low=1.0),
        dict(policy_loss_type="cispo", cispo_epsilon_high=-0.1),
        dict(policy_loss_type="sapo", sapo_tau_pos=0.0),
        dict(policy_loss_type="sapo", sapo_tau_neg=-1.0),
        dict(sampler_logprobs=lp),  # TIS without a cap
        dict(tis_cap=2.0),  # a cap without sampler log-probs
        dict(sampler_logprobs=lp, tis_cap=0.0),
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            pl(lp, lp, a, m, **kw)
    with pytest.raises(AssertionError):
        pl(lp, lp, a, m, sampler_logprobs=lp[:, :2], tis_cap=2.0)
