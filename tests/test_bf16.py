"""bfloat16 compute (``model.dtype=bfloat16``: activations and matmuls in bfloat16, the sampler's
and the update's forward passes alike; parameters, Adam and the loss in float32) trains like
float32: from the same warm-started parameters, a few RL steps of the embedded default
``configs/arithmetic.py:grpo`` (P = 64 prompts x 8 rollouts) reach the same rewards and
held-out accuracy within sampling noise.

The warm start itself is shared (done once, in float32): 300 Adam steps at lr 1e-3 amplify the
rounding differences into different trajectories (measured here once: bfloat16 ended at SFT
loss 0.66 and mean@1 0.405, float32 at 0.80 and 0.207), which says nothing about RL.
"""

import jax
import numpy as np
import pytest

from configs import arithmetic
from grpo_jax import evaluation, steps, train
from grpo_jax.experiment import build_experiment

_STEPS = 4
# Tolerances: the two runs sample different completions (different logits), so they agree in
# distribution only. One step's reward_mean (+-1 rewards, 512 rollouts in 64 groups) has a
# standard deviation of ~0.04 at a ~30% pass rate, the 4-step mean ~0.02, the difference of two
# runs ~0.03: 0.1 is > 3 sigma. Held-out mean@1 (200 problems x 8 samples, the same problems):
# the difference's sampling sd is <= 0.016: 0.06 is > 3.5 sigma.
_REWARD_TOL = 0.1
_EVAL_TOL = 0.06


def _config(dtype):
    c = arithmetic.get_config("grpo")
    c.model.dtype = dtype
    c.steps = _STEPS
    c.mesh.num_devices = 1
    c.logging.tensorboard = False
    c.logging.progress_bar = False
    return c


def _rl(dtype, params):
    """(mean@1 before, the rows of `_STEPS` RL steps, mean@1 after) from ``params``."""
    exp = build_experiment(_config(dtype))
    try:
        key = jax.random.PRNGKey(7)
        before = evaluation.evaluate(exp, params, key)["mean_at_1"]
        run, _ = steps.init_run(exp, params=params)
        fns, source, rows = steps.make_steps(exp), exp.make_source(), []
        keep = lambda result: rows.append(result.row)
        run, _ = train.run_steps(exp, fns, run, source, until=_STEPS, hooks=(keep,))
        after = evaluation.evaluate(exp, run.train.params, key)["mean_at_1"]
        return before, rows, after
    finally:
        exp.close()


@pytest.mark.slow
def test_bfloat16_compute_reaches_the_rewards_of_float32():
    exp = build_experiment(_config("float32"))
    try:
        run, _ = steps.init_run(exp)  # the config's 300-step warm start, float32
        params = jax.device_get(run.train.params)
    finally:
        exp.close()
    b32, r32, a32 = _rl("float32", params)
    b16, r16, a16 = _rl("bfloat16", params)
    for r in r16:
        assert r["skipped_updates"] == 0 and np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"])
    m32 = np.mean([r["reward_mean"] for r in r32])
    m16 = np.mean([r["reward_mean"] for r in r16])
    print(
        f"reward_mean over {_STEPS} steps: float32 {m32:.4f}, bfloat16 {m16:.4f}; mean@1 before "
        f"{b32:.4f} / {b16:.4f}, after {a32:.4f} / {a16:.4f}"
    )
    assert m32 > -0.9 and m16 > -0.9  # the warm start taught the format (all wrong is -1)
    assert abs(m16 - m32) <= _REWARD_TOL
    assert abs(b16 - b32) <= _EVAL_TOL  # the same parameters, sampled in either precision
    assert abs(a16 - a32) <= _EVAL_TOL
