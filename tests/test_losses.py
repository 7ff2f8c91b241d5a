"""Tests for grpo_jax.logprobs (log-probs and entropies from logits) and grpo_jax.losses (policy
loss, KL, aggregation, PPO baseline pieces)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax import logprobs as logprobs_lib
from grpo_jax import losses

MODES = losses.LOSS_AGG_MODES
F32 = jnp.float32

_LOSS_ARRAYS = ("ref_logprobs", "sampler_logprobs", "sample_weights", "denominator", "logits")


def pl(logprobs, old_logprobs, advantages, completion_mask, **kw):
    """``losses.policy_loss`` with the ``PolicyLossConfig`` fields as keywords (the tests'
    shorthand): ``pl(lp, old, a, m, epsilon_high=0.28, ref_logprobs=ref)``."""
    arrays = {k: kw.pop(k) for k in _LOSS_ARRAYS if k in kw}
    cfg = losses.PolicyLossConfig(**kw)
    return losses.policy_loss(logprobs, old_logprobs, advantages, completion_mask, cfg, **arrays)


# Jitted entry points: one compile per shape/static config is much cheaper on CPU than eager
# op-by-op dispatch. (Float arguments are traced, so their eager checks are tested separately.)
PL = jax.jit(
    pl,
    static_argnames=("loss_agg_mode", "ratio_level", "kl_kind", "max_len", "dual_clip"),
)
TL = jax.jit(logprobs_lib.token_logprobs, static_argnames=("chunk_size",))
EL = jax.jit(logprobs_lib.entropy_from_logits, static_argnames=("chunk_size",))
LFL = jax.jit(logprobs_lib.logprobs_from_logits, static_argnames=("chunk_size",))
VL = jax.jit(losses.value_loss, static_argnames=("loss_agg_mode", "max_len"))


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def naive_token_logprobs(logits, tokens, temperature=1.0):
    """Unchunked autodiff reference (materialises the float32 log-softmax)."""
    x = jax.nn.log_softmax(logits.astype(F32) / temperature, axis=-1)[:, :-1]
    return jnp.take_along_axis(x, tokens[:, 1:, None], axis=-1)[..., 0]


def normal(seed, shape, scale=1.0, dtype=F32):
    """numpy-drawn test data (jax.random would compile a PRNG kernel per shape: slow on CPU)."""
    return jnp.asarray(scale * np.random.default_rng(seed).normal(size=shape), dtype)


def randint(seed, shape, high):
    return jnp.asarray(np.random.default_rng(seed).integers(0, high, size=shape), jnp.int32)


def random_logits(seed, shape, dtype=F32, scale=3.0):
    return normal(seed, shape, scale, dtype)


# ================================================================ log-probs from logits


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_logprobs_from_logits_matches_numpy(dtype):
    logits = random_logits(0, (2, 5, 11), dtype)
    targets = randint(1, (2, 5), 11)
    for temp in (1.0, 0.6):
        out = LFL(logits, targets, temp, chunk_size=2)
        assert out.dtype == jnp.float32 and out.shape == (2, 5)
        ref = np.take_along_axis(
            np_log_softmax(np.asarray(logits.astype(F32)) / temp),
            np.asarray(targets)[..., None],
            -1,
        )[..., 0]
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 3, 6, 7, 100])
def test_token_logprobs_shift_and_chunking(chunk_size):
    logits = random_logits(2, (3, 7, 13))
    tokens = randint(3, (3, 7), 13)
    out = TL(logits, tokens, 0.8, chunk_size=chunk_size)
    assert out.shape == (3, 6) and out.dtype == jnp.float32
    ref = np.take_along_axis(
        np_log_softmax(np.asarray(logits)[:, :-1] / 0.8), np.asarray(tokens)[:, 1:, None], -1
    )[..., 0]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_next_token_oracle_model_has_zero_logprob(dtype):
    """A 'model' putting all mass on the next token scores every completion token at log 1 = 0."""
    tokens = randint(4, (2, 9), 50)
    nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    logits = (1e4 * jax.nn.one_hot(nxt, 50)).astype(dtype)
    out = TL(logits, tokens, chunk_size=4)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((2, 8), np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_logprobs_gradient_matches_naive(dtype):
    logits = random_logits(5, (2, 10, 17), dtype)
    tokens = randint(6, (2, 10), 17)
    w = normal(7, (2, 9))

    def f(fn, x):
        return jnp.sum(w * fn(x))

    g = jax.jit(jax.grad(functools.partial(f, lambda x: TL(x, tokens, 0.7, chunk_size=4))))(logits)
    g_ref = jax.grad(functools.partial(f, lambda x: naive_token_logprobs(x, tokens, 0.7)))(logits)
    assert g.dtype == dtype and g.shape == logits.shape
    np.testing.assert_allclose(
        np.asarray(g, np.float32), np.asarray(g_ref, np.float32), rtol=1e-5, atol=1e-6
    )
    # the shifted-out last position never receives gradient
    np.testing.assert_array_equal(np.asarray(g[:, -1], np.float32), 0.0)


def test_native_16bit_slicing_path(monkeypatch):
    """The path GPU/TPU take (16-bit logits sliced as they are) gives the same values/grads."""
    logits = random_logits(21, (2, 7, 9), jnp.bfloat16)
    tokens = randint(22, (2, 7), 9)

    def run():  # a fresh function each time: no trace-cache reuse
        return jax.jit(
            jax.value_and_grad(
                lambda x: jnp.sum(logprobs_lib.token_logprobs(x, tokens, chunk_size=3))
            )
        )(logits)

    ref = run()
    monkeypatch.setattr(logprobs_lib, "_INT_VIEW_BACKENDS", ())
    hlo = jax.jit(lambda x: logprobs_lib.token_logprobs(x, tokens, chunk_size=3)).lower(logits)
    assert "bitcast_convert" not in hlo.as_text()
    out = run()
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))
    np.testing.assert_array_equal(np.asarray(out[1], np.float32), np.asarray(ref[1], np.float32))


def test_garbage_logits_at_masked_positions_get_zero_gradient():
    logits = np.array(random_logits(23, (2, 6, 5)))
    logits[0, 4:] = np.nan  # positions 4, 5 of row 0: masked below
    logits[1, 5] = np.inf
    tokens = randint(24, (2, 6), 5)
    m = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])

    def f(x):
        lp = logprobs_lib.token_logprobs(x, tokens, chunk_size=4)
        return pl(lp, jax.lax.stop_gradient(lp), jnp.array([1.0, -1.0]), m)[0]

    val, g = jax.jit(jax.value_and_grad(f))(jnp.asarray(logits))
    assert np.isfinite(val) and np.all(np.isfinite(g))
    np.testing.assert_array_equal(np.asarray(g)[0, 4:], 0.0)
    np.testing.assert_array_equal(np.asarray(g)[1, 5], 0.0)
    assert np.all(np.abs(np.asarray(g)[0, :4]).sum(-1) > 0)


def test_token_logprobs_vmap_matches_loop():
    logits = random_logits(8, (3, 2, 6, 7))
    tokens = randint(9, (3, 2, 6), 7)
    f = functools.partial(TL, chunk_size=4)
    out = jax.vmap(f)(logits, tokens)
    for i in range(3):
        np.testing.assert_allclose(out[i], f(logits[i], tokens[i]), rtol=1e-6)


def test_entropy_from_logits():
    v = 9
    np.testing.assert_allclose(EL(jnp.zeros((2, 3, v))), math.log(v), rtol=1e-6)
    np.testing.assert_allclose(
        EL(1e4 * jax.nn.one_hot(jnp.zeros((2, 3), jnp.int32), v)), 0.0, atol=1e-6
    )
    logits = random_logits(10, (2, 5, v))
    p = np.exp(np_log_softmax(np.asarray(logits) / 0.5))
    ref = -(p * np.log(p)).sum(-1)
    np.testing.assert_allclose(EL(logits, 0.5, chunk_size=2), ref, rtol=1e-5)
    # differentiable (entropy bonus): matches autodiff of the unchunked formula
    g = jax.grad(lambda x: jnp.sum(EL(x, chunk_size=2)))(logits)
    g_ref = jax.grad(lambda x: jnp.sum(-jnp.sum(jax.nn.softmax(x) * jax.nn.log_softmax(x), -1)))(
        logits
    )
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-6)


def test_logprob_argument_errors():
    x, t = jnp.zeros((2, 3, 4)), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="temperature"):
        logprobs_lib.token_logprobs(x, t, 0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        logprobs_lib.token_logprobs(x, t, chunk_size=0)
    with pytest.raises(AssertionError):
        logprobs_lib.token_logprobs(x, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(AssertionError):
        logprobs_lib.logprobs_from_logits(x, t.astype(F32))


# ================================================================ KL estimators


def test_kl_hand_values():
    lp, ref = jnp.array([-1.0, -2.0]), jnp.array([-0.5, -2.5])  # delta = +0.5, -0.5
    np.testing.assert_allclose(losses.kl(lp, ref, "k1"), [-0.5, 0.5], rtol=1e-6)
    np.testing.assert_allclose(losses.kl(lp, ref, "k2"), [0.125, 0.125], rtol=1e-6)
    np.testing.assert_allclose(
        losses.kl(lp, ref, "k3"), [math.exp(0.5) - 1.5, math.exp(-0.5) - 0.5], rtol=1e-5
    )


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("log_ratio", [100.0, -100.0, 1e30])
def test_kl_extreme_log_ratio_is_finite(kind, log_ratio):
    lp, ref = jnp.array([0.0]), jnp.array([log_ratio])  # delta = log_ratio

    def f(x):
        return jnp.sum(losses.kl(x, ref, kind))

    val, grad = jax.value_and_grad(f)(lp)
    assert np.isfinite(val) and np.all(np.isfinite(grad))
    assert float(grad[0]) != 0.0  # straight-through clamp
    d = max(-20.0, min(20.0, log_ratio))
    expect = {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1}[kind]
    np.testing.assert_allclose(val, expect, rtol=1e-5)


def test_kl_gradient_wrt_policy_logprobs():
    lp = jnp.array([-1.0, -2.0, -0.3])
    ref = jnp.array([-0.5, -2.5, -0.3])
    d = np.asarray(ref - lp)
    expect = {"k1": np.ones(3), "k2": -d, "k3": 1.0 - np.exp(d)}  # d k / d logprobs
    for kind, e in expect.items():
        g = jax.grad(lambda x: jnp.sum(losses.kl(x, ref, kind)))(lp)
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_term_in_policy_loss_has_nonzero_gradient(kind):
    lp = jnp.array([[-1.0, -2.0, 7.0]])
    ref = jnp.array([[-0.5, -2.5, jnp.nan]])
    m = jnp.array([[1, 1, 0]])
    d = np.array([0.5, -0.5])
    per_tok = {"k1": -d, "k2": d**2 / 2, "k3": np.exp(d) - d - 1}[kind]
    dk = {"k1": np.ones(2), "k2": -d, "k3": 1 - np.exp(d)}[kind]

    def f(x):
        return PL(x, x, jnp.zeros(1), m, ref_logprobs=ref, kl_coef=0.1, kl_kind=kind)

    (loss, aux), g = jax.value_and_grad(f, has_aux=True)(lp)
    np.testing.assert_allclose(loss, 0.1 * per_tok.mean(), rtol=1e-5)
    np.testing.assert_allclose(aux["kl"], per_tok.mean(), rtol=1e-5)
    np.testing.assert_allclose(g[0, :2], 0.1 * dk / 2, rtol=1e-5)
    assert np.any(np.asarray(g) != 0) and g[0, 2] == 0


# ================================================================ policy loss: hand values


def _padded_6_and_2s():
    """Two rows whose per-token losses are [[6]] and [[2, 2, 2, 2, 2]] (ratio 1, A = -6, -2)."""
    nan = jnp.nan
    lp = jnp.array([[-0.7, nan, jnp.inf, -jnp.inf, nan], [-1.0, -0.5, -2.0, -0.1, -0.3]])
    m = jnp.array([[1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    return lp, m, jnp.array([-6.0, -2.0])


@pytest.mark.parametrize(
    "mode,loss,loss_sum,den,max_len",
    [
        ("token-mean", 16 / 6, 16.0, 6.0, None),
        ("seq-mean-token-mean", 4.0, 8.0, 2.0, None),
        ("seq-mean-token-sum", 8.0, 16.0, 2.0, None),
        ("seq-mean-token-sum-norm", 16 / 10, 16.0, 10.0, None),
        ("seq-mean-token-sum-norm", 1.0, 16.0, 16.0, 8),
    ],
)
def test_aggregation_modes_hand_values(mode, loss, loss_sum, den, max_len):
    lp, m, a = _padded_6_and_2s()
    out, aux = PL(lp, lp, a, m, loss_agg_mode=mode, max_len=max_len)
    np.testing.assert_allclose(out, loss, rtol=1e-6)
    np.testing.assert_allclose(aux["loss_sum"], loss_sum, rtol=1e-6)
    np.testing.assert_allclose(aux["denominator"], den, rtol=1e-6)
    np.testing.assert_allclose(aux["per_rollout_loss"], [6.0, 2.0], rtol=1e-6)
    assert float(aux["num_tokens"]) == 6.0


def test_fully_masked_row_does_not_dilute_seq_means():
    lp, m, a = _padded_6_and_2s()
    lp3 = jnp.concatenate([lp, jnp.full((1, 5), jnp.nan)])
    m3 = jnp.concatenate([m, jnp.zeros((1, 5), jnp.int32)])
    a3 = jnp.array([-6.0, -2.0, jnp.nan])
    out, aux = PL(lp3, lp3, a3, m3, loss_agg_mode="seq-mean-token-mean")
    np.testing.assert_allclose(out, 4.0, rtol=1e-6)
    assert float(aux["denominator"]) == 2.0 and float(aux["per_rollout_loss"][2]) == 0.0
    out, _ = PL(lp3, lp3, a3, m3)
    np.testing.assert_allclose(out, 16 / 6, rtol=1e-6)
    out, aux = PL(lp3[2:], lp3[2:], a3[2:], m3[2:])  # nothing in the batch
    assert float(out) == 0.0 and float(aux["denominator"]) == 0.0


def _one_token_rows(ratios, advantages):
    old = jnp.zeros((len(ratios), 1))
    return (
        jnp.log(jnp.asarray(ratios, F32))[:, None],
        old,
        jnp.asarray(advantages, F32),
        jnp.ones((len(ratios), 1)),
    )


def test_clipped_surrogate_and_clip_fraction_hand_values():
    lp, old, a, m = _one_token_rows([0.5, 0.5, 1.5, 1.5], [1.0, -1.0, 1.0, -1.0])
    loss, aux = PL(lp, old, a, m, epsilon_low=0.2, epsilon_high=0.2)
    per_row = [-0.5, 0.8, -1.2, 1.5]  # max(-A r, -A clip(r, .8, 1.2))
    np.testing.assert_allclose(aux["per_rollout_loss"], per_row, rtol=1e-6)
    np.testing.assert_allclose(loss, np.mean(per_row), rtol=1e-6)
    # clipped: (A=-1, r=.5) and (A=+1, r=1.5); not clipped: (A=+1, r=.5), (A=-1, r=1.5)
    np.testing.assert_allclose(aux["clip_fraction"], 0.5)
    np.testing.assert_allclose(aux["ratio_mean"], 1.0, rtol=1e-6)
    k3 = [2 - math.log(2) - 1] * 2 + [1 / 1.5 + math.log(1.5) - 1] * 2
    np.testing.assert_allclose(aux["approx_kl"], np.mean(k3), rtol=1e-5)


@pytest.mark.parametrize("a,clipped", [(1.0, 0.0), (-1.0, 1.0)])
def test_clip_fraction_regression_ratio_half(a, clipped):
    lp, old, adv, m = _one_token_rows([0.5], [a])
    _, aux = PL(lp, old, adv, m, epsilon_low=0.2, epsilon_high=0.2)
    assert float(aux["clip_fraction"]) == clipped


def test_clip_higher_and_dual_clip():
    lp, old, a, m = _one_token_rows([1.25], [1.0])
    np.testing.assert_allclose(PL(lp, old, a, m, epsilon_high=0.2)[0], -1.2, rtol=1e-6)
    # the default is DAPO's clip-higher 0.28: the ratio 1.25 is not clipped
    np.testing.assert_allclose(PL(lp, old, a, m)[0], -1.25, rtol=1e-6)
    lp, old, a, m = _one_token_rows([5.0, 2.0, 0.1], [-1.0, -1.0, -1.0])
    _, aux = PL(lp, old, a, m)
    np.testing.assert_allclose(aux["per_rollout_loss"], [5.0, 2.0, 0.8], rtol=1e-6)
    _, aux = PL(lp, old, a, m, dual_clip=3.0)
    np.testing.assert_allclose(aux["per_rollout_loss"], [3.0, 2.0, 0.8], rtol=1e-6)
    # dual clip leaves positive advantages alone
    lp, old, a, m = _one_token_rows([5.0], [1.0])
    np.testing.assert_allclose(PL(lp, old, a, m, dual_clip=3.0)[0], -1.28, rtol=1e-6)
    # dual_clip 0 is off (the config's spelling), as None is
    _, aux = PL(*_one_token_rows([5.0], [-1.0]), dual_clip=0.0)
    np.testing.assert_allclose(aux["per_rollout_loss"], [5.0], rtol=1e-6)


def test_per_token_advantages_for_ppo():
    lp, old, a, m = _one_token_rows([0.5, 0.5, 1.5, 1.5], [1.0, -1.0, 1.0, -1.0])
    ref = PL(lp, old, a, m)
    out = PL(lp, old, a[:, None], m)  # [R, T] advantages, T = 1
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-6)
    np.testing.assert_allclose(out[1]["clip_fraction"], ref[1]["clip_fraction"])
    # two tokens with different advantages in one row: (-A1 r + -A2 r) / 2 at ratio 1
    loss, aux = PL(
        jnp.zeros((1, 3)),
        jnp.zeros((1, 3)),
        jnp.array([[2.0, -1.0, jnp.nan]]),
        jnp.array([[1, 1, 0]]),
    )
    np.testing.assert_allclose(loss, -0.5, rtol=1e-6)
    np.testing.assert_allclose(aux["per_rollout_loss"], [-0.5], rtol=1e-6)


def test_sequence_level_ratio():
    lp = jnp.array([[0.1, 0.3, jnp.nan]])
    old = jnp.zeros((1, 3))
    m = jnp.array([[1, 1, 0]])
    a = jnp.array([1.0])
    # rho_seq = exp(mean(0.1, 0.3)) = exp(0.2) = 1.2214 > 1.2: clipped with epsilon_high 0.2
    loss, aux = PL(lp, old, a, m, ratio_level="sequence", epsilon_high=0.2)
    np.testing.assert_allclose(loss, -1.2, rtol=1e-6)
    assert float(aux["clip_fraction"]) == 1.0
    loss, aux = PL(lp, old, a, m, ratio_level="sequence", epsilon_high=0.3)
    np.testing.assert_allclose(loss, -math.exp(0.2), rtol=1e-6)
    np.testing.assert_allclose(aux["ratio_mean"], math.exp(0.2), rtol=1e-6)
    # token level for comparison: mean(-exp(.1), -clip(exp(.3)) = -1.2)
    loss, _ = PL(lp, old, a, m, epsilon_high=0.2)
    np.testing.assert_allclose(loss, (-math.exp(0.1) - 1.2) / 2, rtol=1e-6)


def test_sample_weights_scale_advantages_but_not_kl():
    lp = -jnp.abs(normal(11, (3, 4)))
    old = lp + normal(12, (3, 4), 0.3)
    ref = lp + normal(13, (3, 4), 0.3)
    a = normal(14, (3,))
    w = jnp.array([0.5, 2.0, 1.5])
    m = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    kw = dict(ref_logprobs=ref, kl_coef=0.05)
    lw, aux_w = PL(lp, old, a, m, sample_weights=w, **kw)
    lref, _ = PL(lp, old, a * w, m, **kw)
    np.testing.assert_allclose(lw, lref, rtol=1e-5, atol=1e-7)
    # the KL part is unweighted: loss - pg_loss = kl_coef * mean KL (token-mean)
    np.testing.assert_allclose(lw - aux_w["pg_loss"], 0.05 * aux_w["kl"], rtol=1e-5, atol=1e-6)
    # the Prompt-GDRO signal uses the unweighted advantages and no KL
    _, aux_plain = PL(lp, old, a, m)
    np.testing.assert_allclose(aux_w["per_rollout_loss"], aux_plain["per_rollout_loss"], rtol=1e-6)


def test_per_rollout_loss_is_stop_gradient():
    lp = jnp.array([[-1.0, -0.5], [-0.2, -0.3]])
    g = jax.grad(
        lambda x: jnp.sum(
            PL(x, x + 0.1, jnp.array([1.0, -1.0]), jnp.ones((2, 2)))[1]["per_rollout_loss"]
        )
    )(lp)
    np.testing.assert_array_equal(g, 0.0)


def test_entropy_metric_from_logits():
    m = jnp.array([[1, 1, 0]])
    logits = jnp.stack([jnp.zeros(5), 1e4 * jax.nn.one_hot(2, 5), jnp.full(5, jnp.nan)])[None]
    _, aux = PL(jnp.zeros((1, 3)), jnp.zeros((1, 3)), jnp.ones(1), m, logits=logits)
    np.testing.assert_allclose(aux["entropy"], math.log(5) / 2, rtol=1e-6)


def test_policy_loss_argument_errors():
    lp, m, a = jnp.zeros((2, 3)), jnp.ones((2, 3)), jnp.zeros(2)
    bad = [
        dict(loss_agg_mode="mean"),
        dict(ratio_level="seq"),
        dict(kl_kind="k4"),
        dict(epsilon_low=1.0),
        dict(epsilon_high=-0.1),
        dict(dual_clip=1.0),
        dict(kl_coef=0.1),
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            pl(lp, lp, a, m, **kw)
    with pytest.raises(AssertionError):
        pl(lp, lp, jnp.zeros(3), m)
    with pytest.raises(AssertionError):
        pl(lp, lp[:, :2], a, m)
    with pytest.raises(AssertionError):
        pl(lp, lp, a, m, sample_weights=jnp.ones(3))


# ================================================================ properties

R, T = 4, 6
# every aggregation mode with token ratios, plus sequence ratios and dual clip once each
CONFIGS = [(mode, "token", None) for mode in MODES] + [
    ("seq-mean-token-mean", "sequence", None),
    ("token-mean", "token", 3.0),
]


@jax.jit
def _losses_and_grads(lp, old, a, m, ref, w):
    """Loss and d loss / d logprobs for every config in CONFIGS (one compile for all)."""
    out = []
    for mode, level, dual in CONFIGS:
        out.append(
            jax.value_and_grad(
                lambda x: pl(
                    x,
                    old,
                    a,
                    m,
                    loss_agg_mode=mode,
                    ratio_level=level,
                    ref_logprobs=ref,
                    kl_coef=0.1,
                    sample_weights=w,
                    dual_clip=dual,
                    epsilon_high=0.28,
                )[0]
            )(lp)
        )
    return out


@st.composite
def batch(draw):
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    lens = np.array(draw(st.lists(st.integers(0, T), min_size=R, max_size=R)))
    m = (np.arange(T)[None] < lens[:, None]).astype(np.float32)
    lp = -np.abs(rng.normal(size=(R, T))).astype(np.float32)
    old = (lp + 0.5 * rng.normal(size=(R, T))).astype(np.float32)
    ref = (lp + 0.5 * rng.normal(size=(R, T))).astype(np.float32)
    a = rng.normal(size=R).astype(np.float32)
    w = rng.uniform(0.2, 3.0, size=R).astype(np.float32)
    return lp, old, a, m, ref, w


GARBAGE = [np.nan, np.inf, -np.inf, 1e30, -1e30]


@settings(max_examples=15, deadline=None)
@given(batch(), st.integers(0, 2**16))
def test_property_masked_garbage_changes_neither_loss_nor_gradient(data, seed):
    lp, old, a, m, ref, w = data
    rng = np.random.default_rng(seed)
    masked = m == 0
    dirty = []
    for x in (lp, old, ref):
        x = x.copy()
        x[masked] = rng.choice(GARBAGE, size=int(masked.sum()))
        dirty.append(x)
    empty = m.sum(1) == 0
    a_d, w_d = a.copy(), w.copy()
    a_d[empty], w_d[empty] = np.nan, np.inf
    clean = [np.where(masked, 0.0, x).astype(np.float32) for x in (lp, old, ref)]
    res_clean = _losses_and_grads(clean[0], clean[1], a, m, clean[2], w)
    res_dirty = _losses_and_grads(dirty[0], dirty[1], a_d, m, dirty[2], w_d)
    for (l1, g1), (l2, g2) in zip(res_clean, res_dirty):
        assert np.isfinite(l1) and np.all(np.isfinite(g2))
        np.testing.assert_allclose(l2, l1, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(g2, g1, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(g2)[masked], 0.0)


@jax.jit
def _accumulate(lp, old, a, m, ref, w):
    """Per mode: full-batch loss/grad (plain call) and two micro-batches of R/2 rows, each
    given the full batch's denominator (one compile for all modes)."""
    out = {}
    for mode in MODES:

        def f(lp, old, a, m, ref, w, den):
            return pl(
                lp,
                old,
                a,
                m,
                loss_agg_mode=mode,
                ref_logprobs=ref,
                kl_coef=0.1,
                sample_weights=w,
                max_len=8,
                denominator=den,
            )

        vg = jax.value_and_grad(f, has_aux=True)
        den = losses.loss_denominator(m, mode, max_len=8)
        full = vg(lp, old, a, m, ref, w, None)
        micro = [
            vg(lp[s], old[s], a[s], m[s], ref[s], w[s], den)
            for s in (slice(0, R // 2), slice(R // 2, R))
        ]
        out[mode] = (den, full, micro)
    return out


@settings(max_examples=10, deadline=None)
@given(batch())
def test_property_microbatch_accumulation_equals_full_batch(data):
    """The lengths drawn by hypothesis include fully masked rows and micro-batches without
    any token (denominator 0 locally)."""
    for mode, (den, ((full, aux_full), g_full), micro) in _accumulate(*data).items():
        np.testing.assert_allclose(den, aux_full["denominator"])
        total = sum(lm for (lm, _), _ in micro)
        np.testing.assert_allclose(total, full, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            np.concatenate([g for _, g in micro]), g_full, rtol=1e-5, atol=1e-7
        )
        sums = sum(aux["loss_sum"] for (_, aux), _ in micro)
        dens = sum(aux["denominator"] for (_, aux), _ in micro)
        np.testing.assert_allclose(dens, den)
        np.testing.assert_allclose(sums / dens if dens > 0 else 0.0, full, rtol=1e-5, atol=1e-6)


def _reinforce_loss(lp, a, m, mode, max_len):
    """Independent aggregation formulas for the REINFORCE loss -A * logprob."""
    s = jnp.sum(jnp.where(m > 0, -a[:, None] * lp, 0.0), axis=1)
    n = jnp.sum(m, axis=1)
    return {
        "token-mean": jnp.sum(s) / jnp.sum(n),
        "seq-mean-token-mean": jnp.mean(s / n),
        "seq-mean-token-sum": jnp.mean(s),
        "seq-mean-token-sum-norm": jnp.sum(s) / (lp.shape[0] * max_len),
    }[mode]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ratio_one_gradient_equals_reinforce_every_mode(level):
    """old = current policy: grad of the loss = grad of -A * logprob aggregated the same way."""
    rng = np.random.default_rng(14)
    lp = jnp.asarray(-np.abs(rng.normal(size=(3, 5))), F32)
    a = jnp.asarray(rng.normal(size=3), F32)
    m = jnp.asarray([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], F32)

    @jax.jit
    def grads(lp):  # all modes in one compile
        return [
            (
                jax.grad(lambda x: pl(x, x, a, m, loss_agg_mode=mode, ratio_level=level)[0])(lp),
                jax.grad(lambda x: _reinforce_loss(x, a, m, mode, 5))(lp),
            )
            for mode in MODES
        ]

    for g, g_ref in grads(lp):
        assert float(jnp.max(jnp.abs(g_ref))) > 1e-2
        np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-7)


def test_ratio_one_gradient_equals_reinforce_through_model():
    """Same, for the parameters of a tiny model (logits = hidden @ W, chunked log-probs)."""
    r, t, h, v = 3, 6, 4, 11
    hidden = normal(15, (r, t, h))
    w0 = normal(16, (h, v))
    tokens = randint(17, (r, t), v)
    a = normal(18, (r,))
    m = (jnp.arange(t - 1)[None] < jnp.array([5, 2, 4])[:, None]).astype(F32)

    def lp_fn(wt):
        return TL(hidden @ wt, tokens, chunk_size=2)

    def ppo(wt):
        lp = lp_fn(wt)
        return PL(lp, lp, a, m, loss_agg_mode="seq-mean-token-mean")[0]

    g = jax.grad(ppo)(w0)
    g_ref = jax.grad(lambda wt: _reinforce_loss(lp_fn(wt), a, m, "seq-mean-token-mean", 5))(w0)
    assert float(jnp.max(jnp.abs(g_ref))) > 1e-3
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-6)


# ================================================================ transforms and sharding


def _example(r=8, t=5, seed=9):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, t + 1, size=r)
    m = (np.arange(t)[None] < lens[:, None]).astype(np.float32)
    lp = -np.abs(rng.normal(size=(r, t))).astype(np.float32)
    old = (lp + 0.3 * rng.normal(size=(r, t))).astype(np.float32)
    ref = (lp + 0.3 * rng.normal(size=(r, t))).astype(np.float32)
    a = rng.normal(size=r).astype(np.float32)
    return lp, old, a, m, ref


def test_jit_and_vmap():
    lp, old, a, m, ref = _example()
    f = functools.partial(pl, loss_agg_mode="seq-mean-token-mean", kl_coef=0.1, dual_clip=3.0)
    eager, aux_e = f(lp, old, a, m, ref_logprobs=ref)
    f = jax.jit(f)
    jitted, aux_j = f(lp, old, a, m, ref_logprobs=ref)
    np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-7)
    for key in aux_e:
        np.testing.assert_allclose(aux_j[key], aux_e[key], rtol=1e-5, atol=1e-7)
    # vmap over a leading axis of micro-batches
    stack = lambda x: x.reshape(2, 4, *x.shape[1:])
    out, _ = jax.jit(jax.vmap(lambda *xs: f(*xs[:4], ref_logprobs=xs[4])))(
        *map(stack, (lp, old, a, m, ref))
    )
    for i in range(2):
        sl = slice(4 * i, 4 * i + 4)
        np.testing.assert_allclose(
            out[i], f(lp[sl], old[sl], a[sl], m[sl], ref_logprobs=ref[sl])[0], rtol=1e-6
        )


def test_sharded_over_data_axis_matches_single_device():
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    lp, old, a, m, ref = _example(r=16, t=6, seed=10)
    logits = random_logits(19, (16, 7, 9))
    tokens = randint(20, (16, 7), 9)

    def f(logits, old, a, m, ref):
        lp = TL(logits, tokens, chunk_size=4)
        return PL(
            lp, old, a, m, ref_logprobs=ref, kl_coef=0.1, loss_agg_mode="seq-mean-token-mean"
        )[0]

    fg = jax.jit(jax.value_and_grad(f))
    single = fg(logits, old, a, m, ref)
    rows = NamedSharding(mesh, PartitionSpec("data"))
    put = lambda x: jax.device_put(x, rows)
    sharded = fg(put(logits), put(old), put(a), put(m), put(ref))
    np.testing.assert_allclose(sharded[0], single[0], rtol=1e-6)
    np.testing.assert_allclose(sharded[1], single[1], rtol=1e-5, atol=1e-8)


# ================================================================ PPO baseline pieces


def np_gae(r, v, m, gamma, lam):
    """Reference: GAE over the masked-in positions only (a gap is skipped)."""
    adv = np.zeros_like(r, dtype=np.float64)
    for i in range(r.shape[0]):
        idx = np.flatnonzero(m[i])
        nxt_v, nxt_a = 0.0, 0.0
        for t in idx[::-1]:
            delta = r[i, t] + gamma * nxt_v - v[i, t]
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = v[i, t]
            adv[i, t] = nxt_a
    return adv, np.where(m > 0, adv + v, 0.0)


def test_gae_hand_values():
    nan = np.nan
    r = jnp.array([[0.0, 0.0, 1.0], [0.0, 1.0, nan]])
    v = jnp.array([[0.5, 0.6, 0.7], [0.5, 0.6, jnp.inf]])
    m = jnp.array([[1, 1, 1], [1, 1, 0]])
    adv, ret = losses.gae(r, v, m, gamma=1.0, lam=0.95)
    # row 0: d = (.1, .1, .3); A2 = .3, A1 = .1 + .95*.3 = .385, A0 = .1 + .95*.385 = .46575
    # row 1: value after the last token is 0: d1 = 1 - .6 = .4, d0 = .6 - .5 = .1
    np.testing.assert_allclose(adv, [[0.46575, 0.385, 0.3], [0.48, 0.4, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[0.96575, 0.985, 1.0], [0.98, 1.0, 0.0]], rtol=1e-6)
    # gamma = lam = 1: returns = sum of future rewards
    _, ret = losses.gae(r, v, m, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], rtol=1e-6)


def test_gae_matches_reference_with_gaps_and_garbage():
    rng = np.random.default_rng(12)
    r = rng.normal(size=(3, 7)).astype(np.float32)
    v = rng.normal(size=(3, 7)).astype(np.float32)
    m = (rng.uniform(size=(3, 7)) > 0.3).astype(np.float32)
    r_d, v_d = np.where(m > 0, r, np.nan), np.where(m > 0, v, np.inf)
    adv, ret = jax.jit(functools.partial(losses.gae, gamma=0.9, lam=0.8))(r_d, v_d, m)
    adv_ref, ret_ref = np_gae(r, v, m, 0.9, 0.8)
    np.testing.assert_allclose(adv, adv_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ret, ret_ref, rtol=1e-5, atol=1e-6)


def test_whiten():
    rng = np.random.default_rng(13)
    x = (3 + 2 * rng.normal(size=(3, 5))).astype(np.float32)
    m = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], np.float32)
    xd = np.where(m > 0, x, np.nan)
    out = np.asarray(losses.whiten(xd, m))
    sel = x[m > 0]
    np.testing.assert_allclose(out[m > 0], (sel - sel.mean()) / sel.std(ddof=1), rtol=1e-5)
    assert np.all(out[m == 0] == 0)
    out = np.asarray(losses.whiten(xd, m, shift_mean=False))
    np.testing.assert_allclose(
        out[m > 0], (sel - sel.mean()) / sel.std(ddof=1) + sel.mean(), rtol=1e-5
    )


def test_value_loss_hand_values():
    v = jnp.array([[1.5, 1.1, jnp.nan]])
    v_old = jnp.array([[1.0, 1.0, 0.0]])
    g = jnp.array([[2.0, 0.0, 5.0]])
    m = jnp.array([[1, 1, 0]])
    loss, aux = VL(v, v_old, g, m, clip_range=0.2)
    # tok 0: max((1.5-2)^2 = .25, (1.2-2)^2 = .64)/2 = .32; tok 1: max(1.21, 1.21)/2 = .605
    np.testing.assert_allclose(loss, (0.32 + 0.605) / 2, rtol=1e-6)
    np.testing.assert_allclose(aux["clip_fraction"], 0.5)
    loss, _ = VL(v, v_old, g, m, clip_range=None)
    np.testing.assert_allclose(loss, (0.125 + 0.605) / 2, rtol=1e-6)
    gr = jax.grad(lambda x: VL(x, v_old, g, m)[0])(v)
    # tok 0 uses the clipped branch (zero gradient), tok 1: (V - G) / 2 = .55
    np.testing.assert_allclose(gr, [[0.0, 0.55, 0.0]], rtol=1e-6)
