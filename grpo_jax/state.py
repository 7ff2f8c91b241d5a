"""The pytrees one RL step reads and writes, and the optimizer that updates them.

`TrainState` (what the update changes, checkpointed whole), `Batch` (one step's training rows
on device), `RunState` (train state + controller state + frozen reference: the whole checkpoint)
and `make_optimizer`. Algorithms that need more (PPO's critic) subclass `TrainState` / `Batch`
in their own module (`grpo_jax.algorithms.ppo`).
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import optax


@flax.struct.dataclass
class TrainState:
    """Everything the policy update changes.

    Attributes:
      step: RL steps completed, int32 [].
      params: policy parameters (the model's ``nnx.State`` as a pure dict of arrays).
      opt_state: the optax state of ``Experiment.tx``.
      rng: PRNG key, uint32 [2]; split once per step for sampling.
      skips: consecutive non-finite updates that were skipped, int32 [].
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    skips: jax.Array


@flax.struct.dataclass
class Batch:
    """One step's training rows on device; the leading axis R (rollouts) is sharded over the
    mesh's batch axes (``sharding.batch_sharding``).

    Attributes:
      tokens: [R, Lp + Lc] int32, left-padded prompt then completion.
      attention_mask: [R, Lp + Lc] bool.
      completion_mask: [R, Lc] float32, 1 on generated tokens up to and including EOS.
      advantages: [R] float32 (per-token [R, Lc] for learners that compute them per token).
      sample_weights: [R] float32, the curriculum's per-rollout weights (ones for GRPO).
      old_logprobs: [R, Lc] float32, log-probs under the policy that sampled (equal to the
        current ones when on-policy; then unused).
      ref_logprobs: [R, Lc] float32, log-probs under the frozen reference (zeros without KL).
      sampler_logprobs: [R, Lc] float32, the sampler's own log-probs of the completion (before
        any top-k/top-p truncation), for truncated importance sampling.
    """

    tokens: jax.Array
    attention_mask: jax.Array
    completion_mask: jax.Array
    advantages: jax.Array
    sample_weights: jax.Array
    old_logprobs: jax.Array
    ref_logprobs: jax.Array
    sampler_logprobs: jax.Array


@flax.struct.dataclass
class RunState:
    """A run's whole device state: what a checkpoint holds besides the data position.

    Attributes:
      train: the `TrainState` (or a learner's subclass of it).
      controllers: the curriculum's state pytree (classifier, GDRO scores, arms, ...).
      ref_params: the frozen reference policy (pure dict), None when ``kl_coef == 0``.
    """

    train: Any
    controllers: Any
    ref_params: Any = None


def make_optimizer(opt_cfg, total_updates: int, learning_rate: float | None = None):
    """AdamW with global-norm clipping and a (linear warm-up +) constant or cosine schedule.

    Args:
      opt_cfg: the ``config.optimizer`` section (learning_rate, warmup_steps, schedule, b1, b2,
        weight_decay, grad_clip; 0 = no clipping).
      total_updates: optimizer updates in the run (the cosine schedule's length).
      learning_rate: overrides ``opt_cfg.learning_rate`` (e.g. PPO's critic).
    Returns:
      an ``optax.GradientTransformation``.
    """
    lr = opt_cfg.learning_rate if learning_rate is None else learning_rate
    warmup = int(opt_cfg.warmup_steps)
    if opt_cfg.schedule == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, lr, max(warmup, 1), max(total_updates, warmup + 1)
        )
    elif warmup > 0:
        schedule = optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
        )
    else:
        schedule = optax.constant_schedule(lr)
    parts = []
    if opt_cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(opt_cfg.grad_clip))
    parts.append(
        optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, weight_decay=opt_cfg.weight_decay)
    )
    return optax.chain(*parts)
