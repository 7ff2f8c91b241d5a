"""The pytrees one RL step reads and writes, and the optimizer that updates them.

`TrainState` (what the update changes, checkpointed whole), `Batch` (one step's training rows
on device), `RunState` (train state + controller state + frozen reference: the whole checkpoint)
and `make_optimizer`. Algorithms that need more (PPO's critic) subclass `TrainState` / `Batch`
in their own module (`grpo_jax.algorithms.ppo`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import optax

from grpo_jax import sharding


@flax.struct.dataclass
class TrainState:
    """Everything the policy update changes.

    Attributes:
      step: RL steps completed, int32 [].
      params: policy parameters (the model's ``nnx.State`` as a pure dict of arrays); with LoRA
        the frozen base and the adapters together (`grpo_jax.models.lora`).
      opt_state: the optax state of ``Experiment.tx``, over the trained parameters only
        (``Experiment.trainable(params)``: the adapters with LoRA, else all of them); with
        non-float32 parameters a `MasterWeightsState` (float32 master copy + the AdamW state).
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
      old_logprobs: [R, Lc] float32, log-probs under the policy that sampled (the trainer's
        recomputation at sampling time), or None: on-policy (one pass over one mini-batch) the
        update's ratio is its own detached log-probs, and the batch carries them only for a
        learner that reads them (``Learner.needs_policy_logprobs``: PPO's KL reward penalty).
      ref_logprobs: [R, Lc] float32, log-probs under the frozen reference (None without one).
      sampler_logprobs: [R, Lc] float32, the sampler's own log-probs of the completion (before
        any top-k/top-p truncation), for truncated importance sampling.
    """

    tokens: jax.Array
    attention_mask: jax.Array
    completion_mask: jax.Array
    advantages: jax.Array
    sample_weights: jax.Array
    old_logprobs: jax.Array | None
    ref_logprobs: jax.Array | None
    sampler_logprobs: jax.Array


@dataclasses.dataclass(frozen=True)
class RunState:
    """A run's whole device state: what a checkpoint holds besides the data position.

    Attributes:
      train: the `TrainState` (or a learner's subclass of it).
      controllers: the curriculum's state pytree (classifier, GDRO scores, arms, ...).
      ref_params: the frozen reference policy (pure dict), None when ``kl_coef == 0``.
      in_flight: the batches generated ahead of the update, oldest first (a tuple of
        ``rollout.max_staleness`` `grpo_jax.rollout_queue.Generated`), None when it is 0.

    A pytree whose children are the fields by name; ``in_flight`` is one only when it is not
    None, so a run without rollouts in flight has the checkpoint tree it always had (older
    checkpoints restore, and the files are unchanged).
    """

    train: Any
    controllers: Any
    ref_params: Any = None
    in_flight: Any = None

    def replace(self, **changes) -> RunState:
        return dataclasses.replace(self, **changes)


def _run_state_children(run: RunState):
    names = ("train", "controllers", "ref_params")
    names += ("in_flight",) * (run.in_flight is not None)
    return [(jax.tree_util.GetAttrKey(n), getattr(run, n)) for n in names], len(names)


jax.tree_util.register_pytree_with_keys(
    RunState, _run_state_children, lambda n, children: RunState(*children)
)


def total_updates(config, batching) -> int:
    """Optimizer updates of a run (the cosine schedule's length): ``config.steps`` x
    ``algorithm.num_iterations`` x mini-batches per step (``batching``: `experiment.Batching`)."""
    per_pass = batching.rollouts_per_step // batching.mini_batch_size
    return config.steps * config.algorithm.num_iterations * per_pass


def make_schedule(opt_cfg, total_updates: int, learning_rate: float | None = None):
    """The learning-rate schedule of `make_optimizer` (optax: update count -> learning rate):
    linear warm-up from 0 over ``warmup_steps`` updates, then constant or cosine decay to 0 at
    ``total_updates``."""
    lr = opt_cfg.learning_rate if learning_rate is None else learning_rate
    warmup = int(opt_cfg.warmup_steps)
    if opt_cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, lr, max(warmup, 1), max(total_updates, warmup + 1)
        )
    if warmup > 0:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
        )
    return optax.constant_schedule(lr)


def last_learning_rate(schedule, opt_state) -> jax.Array | None:
    """The learning rate of the latest update applied to ``opt_state`` (``schedule(count - 1)``
    with the count of its optax ``ScaleByScheduleState``; skipped updates do not count), float32
    []; None when the state has no schedule. Traceable (call it inside jit)."""
    is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_sched) if is_sched(x)]
    if not found:
        return None
    return jnp.asarray(schedule(jnp.maximum(found[0].count - 1, 0)), jnp.float32)


def make_optimizer(
    opt_cfg, total_updates: int, learning_rate: float | None = None, master: bool = False
):
    """AdamW with global-norm clipping and a (linear warm-up +) constant or cosine schedule.

    Args:
      opt_cfg: the ``config.optimizer`` section (learning_rate, warmup_steps, schedule, b1, b2,
        weight_decay, grad_clip; 0 = no clipping).
      total_updates: optimizer updates in the run (the cosine schedule's length).
      learning_rate: overrides ``opt_cfg.learning_rate`` (e.g. PPO's critic).
      master: wrap in `master_weights` (float32 master copy; for bfloat16 parameters).
    Returns:
      an ``optax.GradientTransformation``.
    """
    schedule = make_schedule(opt_cfg, total_updates, learning_rate)
    parts = []
    if opt_cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(opt_cfg.grad_clip))
    parts.append(
        optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, weight_decay=opt_cfg.weight_decay)
    )
    tx = optax.chain(*parts)
    return master_weights(tx) if master else tx


class MasterWeightsState(NamedTuple):
    """`master_weights` state: ``master`` the float32 copy of the trained parameters (what the
    optimizer updates), ``inner`` the wrapped optimizer's state (float32 Adam moments)."""

    master: Any
    inner: Any


def master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Mixed-precision training of low-precision (bfloat16) parameters: ``inner`` updates a
    float32 master copy with float32 gradients, and the parameters become the master rounded to
    their dtype (`apply_optimizer`). Without it a bfloat16 AdamW step of ~1e-4 relative size
    rounds away (bfloat16 keeps 8 significant bits)."""

    def init(params):
        master = jax.tree.map(lambda p: jnp.asarray(p).astype(jnp.float32), params)
        return MasterWeightsState(master=master, inner=inner.init(master))

    def update(grads, state, params=None):
        del params
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, inner_state = inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        return updates, MasterWeightsState(master=master, inner=inner_state)

    return optax.GradientTransformation(init, update)


def apply_optimizer(tx, grads, opt_state, params):
    """One optimizer step: ``(new params, new opt_state)``. Plain optimizers: ``tx.update`` and
    ``optax.apply_updates``; a `master_weights` one: the new float32 master in ``params``'
    dtypes (rounded once, never accumulated in low precision)."""
    updates, opt_state = tx.update(grads, opt_state, params)
    if isinstance(opt_state, MasterWeightsState):
        return jax.tree.map(lambda m, p: m.astype(p.dtype), opt_state.master, params), opt_state
    return optax.apply_updates(params, updates), opt_state


def state_shardings(exp_mesh, tx, param_shardings, learner, shapes, trained_shardings=None):
    """Shardings of a train state shaped like ``shapes``: parameters by the mesh rules, every
    parameter-shaped optimizer leaf (Adam mu/nu, a master copy) like its parameter, the rest
    replicated. ``trained_shardings``: those of the optimised parameters when the optimizer
    covers only part of them (LoRA adapters; default all of ``param_shardings``)."""
    repl = sharding.replicated(exp_mesh)
    out = jax.tree.map(lambda _: repl, shapes)
    trained = param_shardings if trained_shardings is None else trained_shardings
    opt = optax.tree_map_params(
        tx, lambda _, s: s, shapes.opt_state, trained, transform_non_params=lambda _: repl
    )
    return out.replace(
        params=param_shardings, opt_state=opt, **learner.extra_shardings(shapes, exp_mesh)
    )
