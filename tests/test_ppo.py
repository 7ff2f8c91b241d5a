"""PPO (grpo_jax.algorithms.ppo): per-token rewards, GAE and whitening against hand-computed
values; the KL to the reference paid once (in the reward or in the loss, ``algorithm.kl_in``);
on-policy batches without placeholder log-probs; float32 master weights for the critic."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import smoke_config

from grpo_jax import algorithms, config_utils, steps, train
from grpo_jax.algorithms.ppo import PPO, PPOState
from grpo_jax.errors import ConfigError
from grpo_jax.experiment import build_experiment
from grpo_jax.state import Batch, MasterWeightsState

NAN = np.nan


class _FixedValues(PPO):
    """PPO whose critic returns ``critic_params`` itself ([R, Lc] values): GAE by hand."""

    def _values(self, critic_params, batch):
        del batch
        return critic_params


# Two rows, Lc = 4: row 0 has 3 completion tokens, row 1 has 2. Masked entries are NaN (they
# must not reach any output).
_MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
_OLD = np.array([[-1.0, -0.5, -2.0, NAN], [-0.3, -0.7, NAN, NAN]], np.float32)
_REF = np.array([[-1.2, -0.4, -1.0, NAN], [-0.5, -0.2, NAN, NAN]], np.float32)
_VALUES = np.array([[0.5, 0.6, 0.7, 0.0], [0.1, -0.2, 0.0, 0.0]], np.float32)
_REWARDS = np.array([1.0, -1.0], np.float32)

# kl_coef = 0.1, k1 = old - ref: row 0 [0.2, -0.1, -1.0], row 1 [0.2, -0.5]
#   token rewards = -0.1 * k1, + the outcome reward on the last token
_TOKEN_REWARDS_KL = np.array([[-0.02, 0.01, 0.1 + 1.0, 0], [-0.02, 0.05 - 1.0, 0, 0]])
_TOKEN_REWARDS = np.array([[0, 0, 1.0, 0], [0, -1.0, 0, 0]])
# GAE, gamma = 0.9, lam = 0.8 (gamma * lam = 0.72), delta_t = r_t + 0.9 V_{t+1} - V_t:
#   with the KL: row 0: d2 = 1.1 - 0.7 = 0.4; d1 = 0.01 + 0.63 - 0.6 = 0.04;
#   d0 = -0.02 + 0.54 - 0.5 = 0.02; A2 = 0.4, A1 = 0.04 + 0.72 * 0.4 = 0.328,
#   A0 = 0.02 + 0.72 * 0.328 = 0.25616. Row 1: d1 = -0.95 + 0.2 = -0.75;
#   d0 = -0.02 - 0.18 - 0.1 = -0.3; A1 = -0.75, A0 = -0.3 + 0.72 * -0.75 = -0.84.
_ADV_KL = np.array([[0.25616, 0.328, 0.4, 0], [-0.84, -0.75, 0, 0]])
#   outcome only: row 0: d2 = 0.3, d1 = 0.03, d0 = 0.04; A1 = 0.03 + 0.216 = 0.246,
#   A0 = 0.04 + 0.72 * 0.246 = 0.21712. Row 1: d1 = -0.8, d0 = -0.28, A0 = -0.28 - 0.576.
_ADV = np.array([[0.21712, 0.246, 0.3, 0], [-0.856, -0.8, 0, 0]])


def _whiten(a):
    x = a[_MASK > 0]
    out = np.zeros_like(a)
    out[_MASK > 0] = (x - x.mean()) / np.sqrt(x.var(ddof=1) + 1e-8)
    return out


def _toy_batch():
    z = jnp.zeros((2, 4 + 4), jnp.int32)
    return Batch(
        tokens=z,
        attention_mask=z > 0,
        completion_mask=jnp.asarray(_MASK),
        advantages=jnp.zeros(2),
        sample_weights=jnp.ones(2),
        old_logprobs=jnp.asarray(_OLD),
        ref_logprobs=jnp.asarray(_REF),
        sampler_logprobs=jnp.asarray(_OLD),
    )


@pytest.mark.parametrize(
    "kl_coef,kl_in,token_rewards,adv",
    [
        (0.1, "reward", _TOKEN_REWARDS_KL, _ADV_KL),
        (0.0, "reward", _TOKEN_REWARDS, _ADV),  # no reference
        (0.1, "loss", _TOKEN_REWARDS, _ADV),  # the KL goes to the loss: rewards are outcomes
    ],
    ids=["kl-in-reward", "no-reference", "kl-in-loss"],
)
def test_token_rewards_returns_and_gae_equal_hand_computed_values(
    kl_coef, kl_in, token_rewards, adv
):
    ppo = _FixedValues(gamma=0.9, lam=0.8, kl_coef=kl_coef, kl_kind="k1", kl_in=kl_in)
    assert ppo.needs_policy_logprobs == (kl_coef > 0 and kl_in == "reward")
    batch = _toy_batch()
    np.testing.assert_allclose(
        ppo.token_rewards(batch, jnp.asarray(_REWARDS)), token_rewards, rtol=0, atol=1e-6
    )
    state = PPOState(None, None, None, None, None, critic_params=jnp.asarray(_VALUES))
    out = jax.jit(ppo.finish_batch)(state, batch, jnp.asarray(_REWARDS))
    np.testing.assert_allclose(out.returns, (adv + _VALUES) * _MASK, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out.old_values, _VALUES * _MASK, rtol=0, atol=1e-7)
    np.testing.assert_allclose(out.advantages, _whiten(adv), rtol=0, atol=2e-6)


def test_token_rewards_with_k3_are_the_k3_estimator():
    """k3 = exp(ref - old) - (ref - old) - 1 (Schulman 2020; TRL PPOTrainer kl_estimator="k3")."""
    ppo = _FixedValues(kl_coef=0.5, kl_kind="k3", kl_in="reward")
    d = np.nan_to_num(_REF - _OLD)
    k3 = (np.exp(d) - d - 1) * _MASK
    want = -0.5 * k3 + _TOKEN_REWARDS
    np.testing.assert_allclose(
        ppo.token_rewards(_toy_batch(), jnp.asarray(_REWARDS)), want, rtol=0, atol=1e-6
    )


# ------------------------------------------------------------------ the KL is paid once


def _update_batch(exp, seed=0):
    R = exp.config.rollout.prompts_per_step * exp.config.rollout.rollouts_per_prompt
    L, Lc = exp.prompt_len + exp.max_new_tokens, exp.max_new_tokens
    g = np.random.default_rng(seed)
    cmask = (np.arange(Lc)[None] < g.integers(1, Lc + 1, (R, 1))).astype(np.float32)
    f = lambda *s: jnp.asarray(g.normal(-2, 0.3, s), jnp.float32)
    return algorithms.PPOBatch(
        tokens=jnp.asarray(g.integers(1, 10, (R, L)), jnp.int32),
        attention_mask=jnp.ones((R, L), bool),
        completion_mask=jnp.asarray(cmask),
        advantages=jnp.asarray(g.normal(size=(R, Lc)), jnp.float32),
        sample_weights=jnp.ones((R,), jnp.float32),
        old_logprobs=None,
        ref_logprobs=f(R, Lc),
        sampler_logprobs=f(R, Lc),
        returns=jnp.asarray(g.normal(size=(R, Lc)), jnp.float32),
        old_values=jnp.asarray(g.normal(size=(R, Lc)), jnp.float32),
    )


@pytest.mark.slow
def test_ppo_pays_the_kl_once_in_the_reward_or_in_the_loss():
    """kl_in="reward": the policy loss has no KL term (equal to the loss without a reference);
    kl_in="loss": it has it (the ``kl`` metric, a different loss)."""

    def update(**overrides):
        cfg = smoke_config("ppo", **overrides)
        exp = build_experiment(cfg, with_data=False)
        state = steps.init_train_state(exp)
        _, m = steps.make_steps(exp).update(state, _update_batch(exp))
        return jax.device_get(m)

    none = update(**{"algorithm.kl_coef": 0.0})
    reward = update(**{"algorithm.kl_coef": 0.5})  # kl_in=None: PPO's default, the reward
    loss = update(**{"algorithm.kl_coef": 0.5, "algorithm.kl_in": "loss"})
    assert "kl" not in none and "kl" not in reward and loss["kl"] > 0
    assert reward["loss"] == none["loss"] and reward["grad_norm"] == none["grad_norm"]
    assert loss["loss"] != none["loss"]


def _captured_batches(cfg):
    """The batch `rl_step` hands to the learner's `finish_batch`, and the one `train` gets."""
    exp = build_experiment(cfg)
    fns = steps.make_steps(exp)
    seen = {}

    def finish(state, batch, rewards):  # (the state is donated to `train` afterwards)
        seen["in"] = batch
        seen["policy"] = fns.logprobs(state.params, batch.tokens, batch.attention_mask)
        return fns.finish_batch(state, batch, rewards)

    run, _ = steps.init_run(exp, warm_start=False)
    probe = dataclasses.replace(fns, finish_batch=finish)
    try:
        train.rl_step(exp, probe, run, exp.make_source())
        return exp, seen
    finally:
        exp.close()


@pytest.mark.slow
def test_on_policy_batches_carry_the_policys_logprobs_only_where_read():
    # GRPO on-policy: nothing reads the old log-probs, the field is absent (no zeros)
    _, seen = _captured_batches(smoke_config("grpo"))
    assert seen["in"].old_logprobs is None
    # PPO on-policy with the KL in the reward: the policy's own log-probs, computed
    exp, seen = _captured_batches(smoke_config("ppo", **{"algorithm.kl_coef": 0.1}))
    b = seen["in"]
    assert exp.batching.on_policy and exp.learner.needs_policy_logprobs
    np.testing.assert_array_equal(b.old_logprobs, seen["policy"])
    # the reference is the starting policy: KL 0, so the token rewards are the outcomes only
    np.testing.assert_allclose(
        exp.learner.token_rewards(b, jnp.zeros(b.tokens.shape[0])), 0.0, atol=1e-6
    )
    # PPO with the KL in the loss: nothing reads them on-policy
    _, seen = _captured_batches(
        smoke_config("ppo", **{"algorithm.kl_coef": 0.1, "algorithm.kl_in": "loss"})
    )
    assert seen["in"].old_logprobs is None


@pytest.mark.parametrize(
    "algorithm,kl_in,match",
    [
        ("grpo", "reward", r"config.algorithm.kl_in='reward' is not one of \(None, 'loss'\)"),
        ("ppo", "both", r"config.algorithm.kl_in='both' is not one of \(None, 'reward', 'loss'\)"),
    ],
)
def test_kl_in_choices_are_validated(algorithm, kl_in, match):
    with pytest.raises(ConfigError, match=match):
        config_utils.validate(smoke_config(algorithm, **{"algorithm.kl_in": kl_in}))


# ------------------------------------------------------------------ master weights


@pytest.mark.slow
def test_ppo_critic_keeps_float32_master_weights_under_bfloat16_parameters():
    """Under model.param_dtype=bfloat16 the critic trains through a float32 master copy, as the
    policy does: its parameters are the master rounded once, and updates far below bfloat16's
    resolution (8 significant bits) accumulate in the master instead of rounding away."""
    cfg = smoke_config(
        "ppo", **{"model.param_dtype": "bfloat16", "ppo.critic_lr": 1e-6, "optimizer.grad_clip": 0}
    )
    exp = build_experiment(cfg, with_data=False)
    state = steps.init_train_state(exp)
    for opt in (state.opt_state, state.critic_opt_state):
        assert isinstance(opt, MasterWeightsState)
        assert {x.dtype for x in jax.tree.leaves(opt.master)} == {jnp.dtype(jnp.float32)}
    trunk = state.critic_params["model"]
    assert {x.dtype for x in jax.tree.leaves(trunk)} == {jnp.dtype(jnp.bfloat16)}
    start = jax.device_get(state.critic_opt_state.master)
    update = steps.make_steps(exp).update
    for i in range(3):
        state, m = update(state, _update_batch(exp, seed=i))
        assert bool(m["update_ok"]) and np.isfinite(float(m["value_loss"]))
    master = jax.device_get(state.critic_opt_state.master)
    params = jax.device_get(state.critic_params)
    # the parameters are the master in their dtype
    jax.tree.map(lambda p, mw: np.testing.assert_array_equal(p, mw.astype(p.dtype)), params, master)
    # AdamW's first steps move every weight by ~lr = 1e-6, far below a bfloat16 ulp (~4e-3 at
    # 0.5): the master moved, and no bfloat16 parameter could have
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), master, start)
    assert all(0 < float(v) < 1e-5 for v in jax.tree.leaves(moved["model"]))
