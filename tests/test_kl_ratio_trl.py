"""``algorithm.kl_ratio_correction`` against TRL's own code: `GRPOTrainer._compute_loss` of
trl 1.16 (``use_bias_correction_kl=True``, the KL x importance-ratio estimator) run on the same
inputs as `losses.policy_loss`; loss and gradient with respect to the policy's log-probs equal
within 1e-6 (float32), for every aggregation mode, both ratio levels, and a row without tokens.

Needs the ``parity`` extra (torch, trl); skipped without it.
"""

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_losses import pl

torch = pytest.importorskip("torch")
trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

R, T = 4, 6
_EPS_LOW, _EPS_HIGH, _BETA = 0.2, 0.28, 0.04

# loss_agg_mode -> TRL loss_type, and the denominator TRL divides by. TRL's "grpo" and "luspo"
# take the mean over all R rows, a row without tokens included; `policy_loss` counts only rows
# with a token (`loss_denominator`), so those two are given TRL's denominator R explicitly.
_TRL = {
    "token-mean": ("bnpo", None),
    "seq-mean-token-mean": ("grpo", float(R)),
    "seq-mean-token-sum": ("luspo", float(R)),
    "seq-mean-token-sum-norm": ("dr_grpo", None),
}


def _inputs(seed=0):
    g = np.random.default_rng(seed)
    lengths = np.array([6, 3, 0, 5])  # row 2 has no tokens
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    old = g.normal(-1.5, 0.5, (R, T)).astype(np.float32)
    logprobs = (old + g.normal(0, 0.3, (R, T))).astype(np.float32)  # ratios in and out of clip
    ref = (old + g.normal(0, 0.4, (R, T))).astype(np.float32)
    adv = g.normal(0, 1, R).astype(np.float32)
    return logprobs, old, ref, adv, mask


def _trl_loss_and_grad(logprobs, old, ref, adv, mask, loss_type, level, correction):
    """TRL's `_compute_loss` on these log-probs: the model forward is replaced by a leaf tensor
    (the policy's per-token log-probs), everything after it is TRL's code."""
    lp = torch.tensor(logprobs, requires_grad=True)
    one = lambda x, **_: x
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=_BETA,
        loss_type=loss_type,
        epsilon_low=_EPS_LOW,
        epsilon_high=_EPS_HIGH,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=T,
        _entropy_bonus_enabled=False,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        accelerator=types.SimpleNamespace(
            gather=one, reduce=one, gather_for_metrics=one, num_processes=1, sync_gradients=True
        ),
        args=types.SimpleNamespace(use_bias_correction_kl=correction, delta=None),
    )
    inputs = {
        "prompt_ids": torch.zeros((R, 2), dtype=torch.long),
        "prompt_mask": torch.ones((R, 2), dtype=torch.long),
        "completion_ids": torch.zeros((R, T), dtype=torch.long),
        "completion_mask": torch.tensor(mask),
        "advantages": torch.tensor(adv),
        "old_per_token_logps": torch.tensor(old),
        "ref_per_token_logps": torch.tensor(ref),
        "num_items_in_batch": torch.tensor(mask.sum()),
    }
    loss = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return float(loss.detach()), lp.grad.numpy()


def _ours(logprobs, old, ref, adv, mask, mode, level, correction, denominator):
    def f(lp):
        return pl(
            lp,
            jnp.asarray(old),
            jnp.asarray(adv),
            jnp.asarray(mask),
            epsilon_low=_EPS_LOW,
            epsilon_high=_EPS_HIGH,
            ratio_level=level,
            loss_agg_mode=mode,
            max_len=T,
            ref_logprobs=jnp.asarray(ref),
            kl_coef=_BETA,
            kl_kind="k3",
            kl_ratio_correction=correction,
            denominator=None if denominator is None else jnp.float32(denominator),
        )[0]

    loss, grad = jax.value_and_grad(f)(jnp.asarray(logprobs))
    return float(loss), np.asarray(grad)


@pytest.mark.parametrize("correction", [True, False], ids=["ratio-corrected", "plain"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", list(_TRL))
def test_kl_ratio_correction_loss_and_gradient_equal_trls(mode, level, correction):
    loss_type, denominator = _TRL[mode]
    x = _inputs()
    want_loss, want_grad = _trl_loss_and_grad(*x, loss_type, level, correction)
    loss, grad = _ours(*x, mode, level, correction, denominator)
    np.testing.assert_allclose(loss, want_loss, rtol=0, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-6)
    assert np.all(grad[2] == 0) and np.all(grad[x[4] == 0] == 0)  # no tokens: no gradient


def test_the_correction_changes_the_gradient_not_only_the_value():
    """The ratio multiplying the KL is live (TRL's `per_token_kl * coef_1`): on these inputs
    the corrected gradient differs from the one with the ratio held constant."""
    logprobs, old, ref, adv, mask = _inputs(1)

    def kl_term(lp, live):
        rho = jnp.exp(lp - old)
        rho = rho if live else jax.lax.stop_gradient(rho)
        d = ref - lp
        return jnp.sum((jnp.exp(d) - d - 1) * rho * mask)

    g_live = jax.grad(kl_term)(jnp.asarray(logprobs), True)
    g_const = jax.grad(kl_term)(jnp.asarray(logprobs), False)
    assert np.abs(np.asarray(g_live - g_const)).max() > 1e-3
    _, want = _trl_loss_and_grad(logprobs, old, ref, adv, mask, "bnpo", "token", True)
    _, ours = _ours(logprobs, old, ref, adv, mask, "token-mean", "token", True, None)
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-6)
