"""Rollouts in flight: the batches generated ahead of the update (``rollout.max_staleness``).

With ``config.rollout.max_staleness = k >= 1`` the step that trains at step ``t`` first dispatches
the generation of the batch for step ``t + k`` from its current parameters (policy version ``t``)
and then scores and trains on the oldest batch in flight, the one generated at step ``t - k``
(`grpo_jax.train.rl_step`; docs/architecture.md, "Rollouts in flight"). The batches in flight are
a tuple of k `Generated`, oldest first, in the run state (``RunState.in_flight``), so a checkpoint
holds them and a resumed run trains on exactly them. This module is that state: its entry, the
form it is kept in (`park` / `unpark`), its checkpoint template (`abstract`) and the sampling keys
of the batches generated before the first update (`fill_key`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import checkpointing, sampling, sharding
from grpo_jax import transfer as xfer


@flax.struct.dataclass
class Generated:
    """One sampling round generated and not yet scored (steps 1-3 of `rl_step`).

    Attributes:
      version: int32 [], the policy version that sampled it: the updates its parameters had
        seen (the step it was dispatched at).
      ids: [P] int32, the drawn prompts.
      placement: `algorithms.Placement`, their bins and rollouts per prompt.
      rollouts: `sampling.Rollouts` [R, ...] on device (``decode_utilisation`` None); its
        ``logprobs`` are the sampler's, the denominator of truncated importance sampling.
      utilisation: [calls] float32, continuous batching's decode utilisation of each sampler
        call; None for the static sampler.
      episodes: multi-turn episodes' host results (`EpisodeTexts`), already complete when
        dispatched (their turns run on the host); None for single completions. Not a pytree
        node: never parked (``max_staleness`` >= 1 refuses an environment).

    Fresh from `grpo_jax.train.dispatch_round` the bookkeeping (version, ids, placement) is host
    numpy; in the run state (`park`) it is on the default device like the controllers.
    """

    version: Any
    ids: Any
    placement: Any
    rollouts: Any
    utilisation: Any = None
    episodes: Any = flax.struct.field(pytree_node=False, default=None)


@dataclasses.dataclass(frozen=True)
class EpisodeTexts:
    """What a round of multi-turn episodes leaves on the host: ``texts`` (each episode whole, to
    read), ``scored`` (what the reward scores, `grpo_jax.envs.Environment.final_text`) and
    ``stats`` (``{"turns": sum, "tool_calls": sum}`` over the round)."""

    texts: tuple
    scored: tuple
    stats: dict


_fold_in = jax.jit(jax.random.fold_in, static_argnums=1)
_FILL_TAG = 0x5741  # keeps the fill keys apart from `fold_in(key, r)` of the sampling rounds


def fill_key(rng: jax.Array, index: int) -> jax.Array:
    """The sampling key of the ``index``-th batch generated before the run's first update (the
    k batches steps 0 .. k-1 train on), from the run's key ``rng`` before step 0 splits it."""
    return _fold_in(rng, _FILL_TAG + index)


def park(mesh, gen: Generated) -> Generated:
    """``gen`` as the run state keeps it: the bookkeeping on the default device (`xfer.put`, as
    the controllers), the rollouts over the batch sharding and the utilisation replicated (the
    layouts `abstract` restores them in, so a resumed run computes with the same ones)."""
    version, ids, placement = xfer.put((np.asarray(gen.version, np.int32), gen.ids, gen.placement))
    rollouts = jax.tree.map(
        lambda x: jax.device_put(x, sharding.batch_sharding(mesh, x.ndim)), gen.rollouts
    )
    util = gen.utilisation
    if util is not None:
        util = jax.device_put(util, sharding.replicated(mesh))
    return Generated(version, ids, placement, rollouts, util)


def unpark(gen: Generated) -> Generated:
    """Inverse of `park` for the bookkeeping: version, ids and placement back as host numpy."""
    version, ids, placement = xfer.to_host((gen.version, gen.ids, gen.placement))
    return gen.replace(version=version, ids=ids, placement=placement)


def abstract(exp) -> tuple[Generated, ...] | None:
    """The checkpoint template of ``exp``'s batches in flight: k `Generated` of shapes, dtypes
    and shardings as `park` leaves them (None when ``rollout.max_staleness`` is 0).

    The placement's shapes are those of the curriculum's ``allocate`` on its initial state; the
    rollouts' those of the sampler (`sampling.generate`, traced only) on R rows."""
    k = exp.run.rollout.max_staleness
    if not k:
        return None
    P, R = exp.run.rollout.prompts_per_step, exp.batching.rollouts_per_step
    ids = np.zeros(P, np.int32)
    placement = exp.curriculum.allocate(exp.curriculum.init(), ids)
    version, ids, placement = checkpointing.abstract_like(xfer.put((np.int32(0), ids, placement)))
    prompts = jax.ShapeDtypeStruct((R, exp.prompt_len), jnp.int32)
    rollouts = jax.eval_shape(
        sharding.under_mesh(
            exp.mesh,
            lambda p, t, m, key: sampling.generate(exp.graphdef, p, t, m, key, exp.train_sampling),
        ),
        exp.abstract_state.params,
        prompts,
        jax.ShapeDtypeStruct(prompts.shape, jnp.bool_),
        jax.random.PRNGKey(0),
    ).replace(decode_utilisation=None)
    rollouts = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=sharding.batch_sharding(exp.mesh, len(s.shape))
        ),
        rollouts,
    )
    util = None
    if exp.run.rollout.decode_slots:
        calls = max(R // exp.batching.generate_batch_size, 1)
        util = jax.ShapeDtypeStruct((calls,), jnp.float32, sharding=sharding.replicated(exp.mesh))
    return (Generated(version, ids, placement, rollouts, util),) * k
