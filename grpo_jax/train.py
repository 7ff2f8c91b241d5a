"""The GRPO / Prompt-GDRO / Rollout-GDRO training loop, top to bottom.

`train_and_evaluate(config, workdir)` is the whole job; `experiments/run.py` is a thin absl
wrapper around it and notebooks call it directly. One RL step (`rl_step`) is, in order:

  1. draw prompts (uniform, or by bin for Prompt-GDRO `resample`)
  2. classify them into pass-rate bins (from past visits only)
  3. allocate rollouts (fixed group size, or Rollout-GDRO) -> segment ids, R fixed
  4. generate R completions (jitted sampler, static shapes)
  5. score them with the verifiable reward (host, worker processes)
  6. group advantages over segment ids (+ Prompt-GDRO advantage weights)
  7. reference log-probs when kl_coef > 0 (old log-probs when the batch is reused)
  8. num_iterations x mini-batches of jitted, donated AdamW updates
  9. controller updates (classifier, Prompt-GDRO scores, Rollout-GDRO arms and price)
 10. metrics row; checkpoint on schedule or on SIGTERM

Host <-> device: only step 5 (detokenise + verify) and the metrics read leave the device.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import signal
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from grpo_jax import advantages as advantages_lib
from grpo_jax import (
    checkpointing,
    config_utils,
    evaluation,
    gdro,
    losses,
    sampling,
    sharding,
    writers,
)
from grpo_jax.experiment import Experiment, build_experiment

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- state


@flax.struct.dataclass
class TrainState:
    """Everything the update changes. Checkpointed whole.

    Attributes:
      step: RL steps completed, int32 scalar.
      params: policy parameters (nested dict of arrays, the model's ``nnx.State`` as a pure dict).
      opt_state: optax AdamW state.
      rng: PRNG key, uint32 [2].
      skips: consecutive non-finite updates that were skipped, int32 scalar.
      critic_params / critic_opt_state: PPO critic (None otherwise).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    skips: jax.Array
    critic_params: Any = None
    critic_opt_state: Any = None


@flax.struct.dataclass
class Batch:
    """One step's training batch on device; leading axis R (rollouts) sharded over the mesh."""

    tokens: jax.Array  # [R, Lp + Lc] int32, left-padded prompt + completion
    attention_mask: jax.Array  # [R, Lp + Lc] bool
    completion_mask: jax.Array  # [R, Lc] float32
    advantages: jax.Array  # [R] float32 (PPO: [R, Lc])
    sample_weights: jax.Array  # [R] float32 (Prompt-GDRO advantage weights; ones otherwise)
    old_logprobs: jax.Array  # [R, Lc] float32 (equal to the current ones when on-policy)
    ref_logprobs: jax.Array  # [R, Lc] float32 (zeros when kl_coef == 0)
    returns: jax.Array  # [R, Lc] float32 (PPO only; zeros otherwise)
    old_values: jax.Array  # [R, Lc] float32 (PPO only; zeros otherwise)


# ----------------------------------------------------------------------------- pure pieces


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Rotary position ids for left-padded rows: 0 at the first real token. [R, L] int32."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def completion_logprobs(
    graphdef,
    params,
    tokens,
    attention_mask,
    prompt_len: int,
    temperature: float,
    group_size: int = 1,
):
    """Log-probs of the completion tokens under the policy, float32 [R, Lc].

    The logits at position t score token t+1 (one-position shift); only the Lc completion
    positions are scored. Temperature as when sampling (grpo.md, "Log-probs from logits").

    Args:
      tokens [R, Lp + Lc] int32 (prompt left-padded to Lp = prompt_len, then the completion),
      attention_mask [R, Lp + Lc] bool, temperature: float (> 0).
      group_size: G > 1 when rows come in consecutive groups of G with identical prompt tokens and
        mask (a GRPO group): the prompt is then run once per group (`Decoder.shared_prefix`), the
        same values up to float rounding for less compute. 1 = every row on its own.
    Raises:
      ValueError: R is not a multiple of group_size.
    """
    model = nnx.merge(graphdef, params)
    positions = positions_from_mask(attention_mask)
    R, L = tokens.shape
    if group_size > 1 and L - prompt_len > 1:
        if R % group_size:
            raise ValueError(f"{R} rows are not a multiple of group_size {group_size}")
        G, lp = group_size, prompt_len
        hp, hc = model.model.shared_prefix(
            tokens[::G, :lp],
            positions[::G, :lp],
            attention_mask[::G, :lp],
            tokens[:, lp:-1],
            positions[:, lp:-1],
            attention_mask[:, lp:-1],
        )
        # position Lp - 1 (the prompt's last token) scores the first completion token
        hidden = jnp.concatenate([jnp.repeat(hp[:, -1:], G, axis=0), hc], axis=1)
    else:
        hidden, _ = model(
            tokens[:, :-1], positions[:, :-1], attention_mask[:, :-1], return_hidden=True
        )
        hidden = hidden[:, prompt_len - 1 :]
    # project only the Lc completion positions to the vocabulary (the prompt's logits are never
    # used: at Lp = 256, Lc = 64 that is 5x less logits memory and LM-head compute)
    return losses.logprobs_from_logits(model.logits(hidden), tokens[:, prompt_len:], temperature)


def make_optimizer(opt_cfg, total_updates: int, learning_rate: float | None = None):
    """AdamW with global-norm clipping and a (warm-up +) constant or cosine schedule."""
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


def _all_finite(tree) -> jax.Array:
    """True when every element of every leaf is finite (bool scalar)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _select(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def make_update_fn(exp: Experiment):
    """Returns a jitted ``update(state, batch) -> (state, metrics)`` for one mini-batch.

    A non-finite loss or gradient norm, or an update that would make a parameter non-finite,
    skips the update (parameters and optimizer state are kept) and increments ``state.skips``;
    a good one resets it.
    """
    cfg = exp.config.algorithm
    graphdef, lp, temperature = exp.graphdef, exp.prompt_len, float(exp.config.rollout.temperature)
    on_policy = exp.on_policy
    ppo = cfg.name == "ppo"

    def loss_fn(params, batch: Batch, denominator=None):
        logprobs = completion_logprobs(
            graphdef, params, batch.tokens, batch.attention_mask, lp, temperature, group
        )
        old = jax.lax.stop_gradient(logprobs) if on_policy else batch.old_logprobs
        loss, aux = losses.policy_loss(
            logprobs,
            old,
            batch.advantages,
            batch.completion_mask,
            epsilon_low=cfg.epsilon_low,
            epsilon_high=cfg.epsilon_high,
            dual_clip=cfg.dual_clip or None,
            loss_agg_mode=cfg.loss_agg_mode,
            max_len=exp.max_new_tokens,
            ref_logprobs=batch.ref_logprobs if cfg.kl_coef > 0 else None,
            kl_coef=cfg.kl_coef,
            kl_kind=cfg.kl_kind,
            sample_weights=batch.sample_weights,
            denominator=denominator,
        )
        return loss, aux

    def critic_loss_fn(critic_params, batch: Batch, denominator=None):
        critic = nnx.merge(exp.critic_graphdef, critic_params)
        positions = positions_from_mask(batch.attention_mask)
        values = critic(batch.tokens[:, :-1], positions[:, :-1], batch.attention_mask[:, :-1])
        values = values[:, lp - 1 :]
        loss, aux = losses.value_loss(
            values,
            batch.old_values,
            batch.returns,
            batch.completion_mask,
            clip_range=cfg.ppo_value_clip,
            denominator=denominator,
        )
        return cfg.ppo_vf_coef * loss, aux

    micro = exp.micro_batch_size
    group = exp.prompt_group_size

    def accumulate(fn, params, batch: Batch, denominator):
        """(loss, aux, grads) of ``fn`` over the batch's rows, ``micro`` rows per forward/backward.

        The loss denominator of the whole mini-batch is passed to every micro-batch, so the summed
        losses and gradients equal the one-pass ones (``losses.policy_loss``, "Micro-batching").
        Micro-batch j holds rows {i * n + j} (n micro-batches; ``split_rows``, whole groups with
        a shared prompt): no row changes device.
        """
        rows = batch.tokens.shape[0]
        if micro >= rows:
            (loss, aux), grads = jax.value_and_grad(fn, has_aux=True)(params, batch)
            return loss, aux, grads
        n = rows // micro
        split = lambda x: split_rows(x, n, group)

        def body(acc, micro_batch):
            (loss, aux), g = jax.value_and_grad(fn, has_aux=True)(params, micro_batch, denominator)
            return jax.tree.map(jnp.add, acc, g), (loss, aux)

        grads, (loss, aux) = jax.lax.scan(
            body, jax.tree.map(jnp.zeros_like, params), jax.tree.map(split, batch)
        )
        aux = {
            k: merge_rows(v, group) if k == "per_rollout_loss" else jnp.mean(v)
            for k, v in aux.items()
        }  # clip fraction, KL, ratio: the mean over micro-batches
        return jnp.sum(loss), aux, grads

    def update(state: TrainState, batch: Batch):
        den = losses.loss_denominator(
            batch.completion_mask, cfg.loss_agg_mode, max_len=exp.max_new_tokens
        )
        loss, aux, grads = accumulate(loss_fn, state.params, batch, den)
        gnorm = optax.global_norm(grads)
        updates, opt_state = exp.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # finite loss and gradient, and no parameter overflowed in the step (huge learning rate)
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm) & _all_finite(params)
        metrics = {
            "loss": loss,
            "grad_norm": gnorm,
            "clip_fraction": aux["clip_fraction"],
            "approx_kl": aux["approx_kl"],
            "ratio_mean": aux["ratio_mean"],
            "per_rollout_loss": aux["per_rollout_loss"],
            "update_ok": ok,
        }
        if "kl" in aux:
            metrics["kl"] = aux["kl"]
        new = state.replace(
            params=_select(ok, params, state.params),
            opt_state=_select(ok, opt_state, state.opt_state),
            skips=jnp.where(ok, 0, state.skips + 1),
        )
        if ppo:
            vloss, _, cgrads = accumulate(
                critic_loss_fn,
                state.critic_params,
                batch,
                losses.loss_denominator(batch.completion_mask, "token-mean"),
            )
            cupdates, copt = exp.critic_tx.update(
                cgrads, state.critic_opt_state, state.critic_params
            )
            cparams = optax.apply_updates(state.critic_params, cupdates)
            cok = jnp.isfinite(vloss)
            new = new.replace(
                critic_params=_select(cok, cparams, state.critic_params),
                critic_opt_state=_select(cok, copt, state.critic_opt_state),
            )
            metrics["value_loss"] = vloss
        return new, metrics

    batch_sharding = sharding.batch_sharding(exp.mesh)
    return jax.jit(
        sharding.under_mesh(exp.mesh, update),
        in_shardings=(exp.state_shardings, batch_sharding),
        out_shardings=(exp.state_shardings, None),
        donate_argnums=0,
    )


def make_take_fn(exp: Experiment):
    """Jitted ``take(batch, idx [mb] int) -> the mini-batch`` laid out as the update takes it.

    The rows are gathered on device and constrained to the batch sharding (an eager ``x[idx]``
    comes back replicated, which a multi-process jit refuses as an argument).
    """

    def take(batch, idx):
        return jax.tree.map(
            lambda x: jax.lax.with_sharding_constraint(
                x[idx], sharding.batch_sharding(exp.mesh, x.ndim)
            ),
            batch,
        )

    return jax.jit(take)


def split_rows(x, chunks: int, group: int = 1):
    """[R, ...] -> [chunks, R / chunks, ...]: chunk j holds the groups {i * chunks + j} of
    ``group`` consecutive rows (group 1: rows {i * chunks + j}). A batch sharded in contiguous row
    blocks over ``data`` x ``fsdp`` is split without moving a row between devices, and a GRPO
    group stays whole (``group`` = rollouts per prompt). Inverse: ``merge_rows``."""
    per = x.shape[0] // chunks
    x = x.reshape(per // group, chunks, group, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape(chunks, per, *x.shape[3:])


def merge_rows(x, group: int = 1):
    """Inverse of ``split_rows``: [chunks, R / chunks, ...] -> [R, ...]."""
    chunks, per = x.shape[:2]
    x = x.reshape(chunks, per // group, group, *x.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape(chunks * per, *x.shape[3:])


def chunked_completion_logprobs(
    graphdef,
    params,
    tokens,
    attention_mask,
    prompt_len: int,
    temperature: float,
    rows_per_chunk: int,
    group_size: int = 1,
):
    """``completion_logprobs`` computed ``rows_per_chunk`` rows at a time (``lax.map``).

    Peak memory is one chunk's activations and logits instead of the whole batch's (at Qwen3-8B
    x 1024 rollouts x 5,120 tokens: 43 GiB instead of 156 GiB per device on 64 chips,
    ``reports/aot.md``). Chunk ``j`` holds rows ``{i * C + j}`` (C = R / rows_per_chunk chunks;
    whole groups of ``group_size`` rows, ``split_rows``),
    so a batch sharded in contiguous row blocks over ``data`` x ``fsdp`` is split without moving
    a row between devices. Rows are independent, so the values equal the unchunked ones up to
    float rounding. Falls back to one pass when ``rows_per_chunk`` does not divide R.

    Args: as ``completion_logprobs`` (group_size: rows per shared prompt, kept whole in a
    chunk); tokens [R, Lp + Lc] int32, attention_mask [R, Lp + Lc] bool.
    Returns: [R, Lc] float32.
    """
    R = tokens.shape[0]
    if rows_per_chunk <= 0 or rows_per_chunk >= R or R % rows_per_chunk:
        return completion_logprobs(
            graphdef, params, tokens, attention_mask, prompt_len, temperature, group_size
        )
    chunks = R // rows_per_chunk
    out = jax.lax.map(
        lambda a: completion_logprobs(
            graphdef, params, a[0], a[1], prompt_len, temperature, group_size
        ),
        (split_rows(tokens, chunks, group_size), split_rows(attention_mask, chunks, group_size)),
    )
    return merge_rows(out, group_size)


def make_concat_fn(exp: Experiment):
    """Jitted ``concat([tree, ...]) -> tree``: the trees' leaves joined along the rows (axis 0)
    and laid out over the batch sharding (an eager concatenation of global arrays would not be)."""

    def concat(parts):
        return jax.tree.map(
            lambda *a: jax.lax.with_sharding_constraint(
                jnp.concatenate(a), sharding.batch_sharding(exp.mesh, a[0].ndim)
            ),
            *parts,
        )

    return jax.jit(concat)


def make_logprobs_fn(exp: Experiment):
    """Jitted ``logprobs(params, tokens, attention_mask) -> [R, Lc]`` (reference / old).

    Computed one micro-batch of rows at a time (``chunked_completion_logprobs``; the micro-batch
    is the mini-batch unless gradients are accumulated), so the pass never needs more activation
    memory than one forward/backward of the update.
    """
    return jax.jit(
        sharding.under_mesh(
            exp.mesh,
            functools.partial(
                chunked_completion_logprobs,
                exp.graphdef,
                prompt_len=exp.prompt_len,
                temperature=float(exp.config.rollout.temperature),
                rows_per_chunk=exp.micro_batch_size,
                group_size=exp.prompt_group_size,
            ),
        )
    )


# ----------------------------------------------------------------------------- controllers


@flax.struct.dataclass
class ControllerState:
    classifier: Any
    prompt_gdro: Any
    rollout_gdro: Any


def init_controllers(exp: Experiment) -> ControllerState:
    return ControllerState(
        classifier=gdro.classifier_init(exp.classifier_cfg, exp.num_prompt_ids),
        prompt_gdro=gdro.prompt_gdro_init(exp.prompt_gdro_cfg, exp.num_bins),
        rollout_gdro=gdro.rollout_gdro_init(exp.rollout_gdro_cfg, exp.num_bins),
    )


# ----------------------------------------------------------------------------- one step


def _timer():
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


@dataclasses.dataclass
class _Round:
    """One sampling round (steps 1-5 of ``rl_step``): P prompts and their R rollouts.

    Host arrays: ids [P] int32, bins [P] int32, segment_ids [R] int32, rows [R] (prompt row of
    each rollout), rewards [R] float32, correct [R] bool, lengths [R] int32, informative [P]
    bool (the group's rewards are not all equal); device arrays: rollouts (``Rollouts``, [R, ...])
    and prompt_mask [R, Lp]; success, alloc: the classifier's bin success rates and the
    allocation the rollouts were generated with.
    """

    ids: np.ndarray
    bins: np.ndarray
    success: Any
    alloc: Any
    segment_ids: np.ndarray
    rows: np.ndarray
    rollouts: Any
    prompt_mask: Any
    rewards: np.ndarray
    correct: np.ndarray
    lengths: np.ndarray
    informative: np.ndarray
    reward_stats: dict
    generated_tokens: int
    times: dict


def _sample_round(exp: Experiment, params, ctrl, source, fns: dict, gen_key, step: int) -> _Round:
    """Steps 1-5 of ``rl_step``: draw, classify, allocate, generate, reward."""
    cfg = exp.config
    algo = cfg.algorithm.name
    P, n_bar = cfg.rollout.prompts_per_step, cfg.rollout.rollouts_per_prompt
    R = P * n_bar
    times = {}

    # 1-2. prompts and their bins (bins from past visits only).
    t = _timer()
    if algo == "prompt_gdro" and cfg.gdro.apply == "resample" and step > 0:
        all_bins = np.asarray(
            gdro.classify(exp.classifier_cfg, ctrl.classifier, exp.all_prompt_ids)
        )
        q = np.asarray(gdro.prompt_gdro_q(exp.prompt_gdro_cfg, ctrl.prompt_gdro, all_bins))
        prompts = source.next_by_bin(q, all_bins)
    else:
        prompts = source.next()
    ids = np.asarray([p["id"] for p in prompts], np.int32)
    bins = np.asarray(gdro.classify(exp.classifier_cfg, ctrl.classifier, jnp.asarray(ids)))

    # 3. rollouts per prompt -> segment ids (R fixed, so shapes never change).
    success = gdro.bin_success(
        exp.classifier_cfg, ctrl.classifier, jnp.asarray(ids), jnp.asarray(bins), exp.num_bins
    )
    if algo == "rollout_gdro":
        alloc = gdro.allocate(
            exp.rollout_gdro_cfg, ctrl.rollout_gdro, bins, success, prompt_ids=ids
        )
    else:
        alloc = gdro.fixed_allocation(bins, n_bar, exp.num_bins)
    segment_ids = np.asarray(alloc.segment_ids, np.int32)
    rows = ids[segment_ids]
    times["prepare"] = t()

    # 4. generate (generate_batch_size rows per sampler call; one call by default).
    t = _timer()
    gbs = exp.generate_batch_size
    keys = [gen_key] if gbs >= R else list(jax.random.split(gen_key, R // gbs))
    parts = [
        fns["generate"](
            exp.graphdef,
            params,
            exp.to_device(exp.prompt_tokens[rows[s : s + gbs]]),
            exp.to_device(exp.prompt_mask[rows[s : s + gbs]]),
            key,
            exp.train_sampling,
        )
        for key, s in zip(keys, range(0, R, gbs))
    ]
    rollouts = parts[0] if len(parts) == 1 else fns["concat"](parts)
    prompt_mask = exp.to_device(exp.prompt_mask[rows])
    completion_tokens = exp.to_host(rollouts.completion_tokens)
    lengths = exp.to_host(rollouts.lengths)
    times["generate"] = t()

    # 5. rewards (host).
    t = _timer()
    texts = [exp.decode(completion_tokens[i, : lengths[i]]) for i in range(R)]
    golds = [exp.golds[r] for r in rows]
    rewards, correct, reward_stats = exp.reward_fn(texts, golds)
    rewards = np.asarray(rewards, np.float32)
    correct = np.asarray(correct, bool)
    seg_max = np.full(P, -np.inf, np.float32)
    seg_min = np.full(P, np.inf, np.float32)
    np.maximum.at(seg_max, segment_ids, rewards)
    np.minimum.at(seg_min, segment_ids, rewards)
    times["reward"] = t()
    return _Round(
        ids=ids,
        bins=bins,
        success=success,
        alloc=alloc,
        segment_ids=segment_ids,
        rows=rows,
        rollouts=rollouts,
        prompt_mask=prompt_mask,
        rewards=rewards,
        correct=correct,
        lengths=lengths,
        informative=seg_max > seg_min,
        reward_stats=dict(reward_stats),
        generated_tokens=int(lengths.sum()),
        times=times,
    )


def _keep_informative_groups(exp: Experiment, rounds: list[_Round], take, concat, P: int) -> _Round:
    """DAPO dynamic sampling (Yu et al. 2025, Eq. 11): the batch of P groups of the same size,
    groups with unequal rewards first (in the order they were sampled); when the rounds ran out
    before P such groups were found, the rest is filled with all-equal groups (zero advantage,
    so they add only the KL term), keeping every shape fixed. Needs a fixed group size.
    """
    n = exp.config.rollout.rollouts_per_prompt
    R = P * n
    order = [(r, g) for r, x in enumerate(rounds) for g in np.flatnonzero(x.informative)]
    order += [(r, g) for r, x in enumerate(rounds) for g in np.flatnonzero(~x.informative)]
    chosen = order[:P]
    src = np.concatenate([r * R + g * n + np.arange(n) for r, g in chosen])  # rows of the rounds
    cat = lambda f: np.concatenate([f(x) for x in rounds])
    ids = np.asarray([rounds[r].ids[g] for r, g in chosen], np.int32)
    bins = np.asarray([rounds[r].bins[g] for r, g in chosen], np.int32)
    alloc = gdro.fixed_allocation(bins, n, exp.num_bins)
    on_device = take(concat([(x.rollouts, x.prompt_mask) for x in rounds]), jnp.asarray(src))
    return _Round(
        ids=ids,
        bins=bins,
        success=rounds[0].success,
        alloc=alloc,
        segment_ids=np.asarray(alloc.segment_ids, np.int32),
        rows=cat(lambda x: x.rows)[src],
        rollouts=on_device[0],
        prompt_mask=on_device[1],
        rewards=cat(lambda x: x.rewards)[src],
        correct=cat(lambda x: x.correct)[src],
        lengths=cat(lambda x: x.lengths)[src],
        informative=np.asarray([rounds[r].informative[g] for r, g in chosen]),
        reward_stats={},
        generated_tokens=0,
        times={},
    )


def rl_step(exp: Experiment, state: TrainState, ctrl: ControllerState, source, fns: dict):
    """One RL step (see the module docstring). Returns (state, ctrl, metrics row)."""
    cfg = exp.config
    algo = cfg.algorithm.name
    times = {}
    P, n_bar = cfg.rollout.prompts_per_step, cfg.rollout.rollouts_per_prompt
    R = P * n_bar

    # 1-5. prompts -> bins -> allocation -> R rollouts -> rewards (one round; with DAPO dynamic
    # sampling, more rounds until P groups have unequal rewards, at most 1 + max_rounds rounds).
    rng, gen_key = jax.random.split(state.rng)
    rounds = [_sample_round(exp, state.params, ctrl, source, fns, gen_key, int(state.step))]
    if cfg.algorithm.dynamic_sampling:
        for r in range(cfg.algorithm.dynamic_sampling_max_rounds):
            if sum(int(x.informative.sum()) for x in rounds) >= P:
                break
            rounds.append(
                _sample_round(
                    exp,
                    state.params,
                    ctrl,
                    source,
                    fns,
                    jax.random.fold_in(gen_key, r + 1),
                    int(state.step),
                )
            )
    rd = (
        rounds[0]
        if len(rounds) == 1
        else _keep_informative_groups(exp, rounds, fns["take"], fns["concat"], P)
    )
    for k in ("prepare", "generate", "reward"):
        times[k] = sum(x.times[k] for x in rounds)
    bins, success, alloc = rd.bins, rd.success, rd.alloc
    segment_ids, rows, rollouts, prompt_mask = rd.segment_ids, rd.rows, rd.rollouts, rd.prompt_mask
    rewards, correct, lengths = rd.rewards, rd.correct, rd.lengths
    reward_stats = {k: sum(x.reward_stats[k] for x in rounds) for k in rounds[0].reward_stats}

    # 6. advantages and Prompt-GDRO weights.
    t = _timer()
    seg = jnp.asarray(segment_ids)
    adv, adv_stats = fns["advantages"](jnp.asarray(rewards), seg)
    rollout_bins = bins[segment_ids]
    if algo == "prompt_gdro" and cfg.gdro.apply == "advantage_weight":
        sample_weights = jnp.asarray(
            gdro.prompt_gdro_weights(
                exp.prompt_gdro_cfg, ctrl.prompt_gdro, jnp.asarray(rollout_bins)
            )
        )
    else:
        sample_weights = jnp.ones((R,), jnp.float32)

    # 7. reference and old log-probs.
    tokens = rollouts.tokens
    attention_mask = jnp.concatenate([prompt_mask, rollouts.completion_mask > 0], axis=1)
    zeros = jnp.zeros_like(rollouts.logprobs)
    ref_logprobs = (
        fns["logprobs"](exp.ref_params, tokens, attention_mask)
        if cfg.algorithm.kl_coef > 0
        else zeros
    )
    old_logprobs = zeros if exp.on_policy else fns["logprobs"](state.params, tokens, attention_mask)
    batch = Batch(
        tokens=tokens,
        attention_mask=attention_mask,
        completion_mask=rollouts.completion_mask,
        advantages=adv,
        sample_weights=sample_weights,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        returns=zeros,
        old_values=zeros,
    )
    if algo == "ppo":
        batch = fns["ppo_advantages"](state.critic_params, batch, jnp.asarray(rewards))
    jax.block_until_ready(batch)
    times["reference"] = t()

    # 8. updates: num_iterations passes of mini-batches.
    t = _timer()
    mb = exp.mini_batch_size
    order_rng = np.random.default_rng([cfg.seed, int(state.step)])
    per_rollout_loss = np.zeros((R,), np.float32)
    upd = []
    for it in range(cfg.algorithm.num_iterations):
        if mb >= R:
            perm = np.arange(R)
        else:  # shuffled rows; whole groups when each group's prompt runs once
            g = exp.prompt_group_size
            perm = (order_rng.permutation(R // g)[:, None] * g + np.arange(g)).reshape(-1)
        for s in range(0, R, mb):
            state, m = fns["update"](state, fns["take"](batch, perm[s : s + mb]))
            if it == 0:
                per_rollout_loss[perm[s : s + mb]] = exp.to_host(m.pop("per_rollout_loss"))
            else:
                m.pop("per_rollout_loss")
            upd.append(m)
    upd = jax.device_get(upd)
    times["update"] = t()

    # 9. controllers (after the update; this step's indicators are added now).
    t = _timer()
    seg = jnp.asarray(segment_ids)
    visit = gdro.visit_outcome(exp.classifier_cfg, jnp.asarray(correct), seg, P)
    any_correct = np.asarray(visit) > 0
    for x in rounds:  # every visited prompt counts, also the groups dynamic sampling dropped
        x_visit = gdro.visit_outcome(
            exp.classifier_cfg, jnp.asarray(x.correct), jnp.asarray(x.segment_ids), P
        )
        ctrl = ctrl.replace(
            classifier=gdro.classifier_update(
                exp.classifier_cfg, ctrl.classifier, jnp.asarray(x.ids), x_visit
            )
        )
    signal_ = gdro.loss_signal(
        exp.prompt_gdro_cfg,
        per_rollout_loss=jnp.asarray(per_rollout_loss),
        correct=jnp.asarray(correct),
    )
    # the same curriculum diagnostics for every algorithm (GRPO is the baseline of the figures)
    diagnostics = gdro.prompt_gdro_diagnostics(exp.num_bins, rollout_bins, rewards=rewards)
    if algo == "prompt_gdro":
        pg, diagnostics = gdro.prompt_gdro_update(
            exp.prompt_gdro_cfg,
            ctrl.prompt_gdro,
            jnp.asarray(rollout_bins),
            signal_,
            rewards=jnp.asarray(rewards),
        )
        ctrl = ctrl.replace(prompt_gdro=pg)
    elif algo == "rollout_gdro":
        rg, rdiag = gdro.rollout_gdro_update(
            exp.rollout_gdro_cfg,
            ctrl.rollout_gdro,
            alloc,
            bins,
            signal_,
            rewards,
            segment_ids,
            bin_success=success,
        )
        diagnostics.update(rdiag)
        ctrl = ctrl.replace(rollout_gdro=rg)
    state = state.replace(
        step=jax.device_put(state.step + 1, state.step.sharding),
        rng=jax.device_put(rng, state.rng.sharding),
    )
    times["controllers"] = t()

    # 10. metrics.
    completion_tokens_total = sum(x.generated_tokens for x in rounds)  # all rounds' compute
    row = {
        "reward_mean": float(rewards.mean()),
        "pass_rate": float(correct.mean()),
        "any_correct_rate": float(any_correct.mean()),
        "completion_length": float(lengths.mean()),
        "truncated_fraction": float(exp.to_host(rollouts.truncated).mean()),
        "advantage_abs_mean": float(np.abs(exp.to_host(adv)).mean()),
        "sample_weight_max": float(exp.to_host(sample_weights).max()),
        "skipped_updates": int(sum(not bool(m["update_ok"]) for m in upd)),
        "consecutive_skips": int(state.skips),
        "generated_tokens": completion_tokens_total,
    }
    for k in upd[0]:
        if k != "update_ok":
            row[k] = float(np.mean([float(m[k]) for m in upd]))
    row.update({f"reward/{k}": int(v) for k, v in reward_stats.items()})
    row.update({f"advantages/{k}": int(v) for k, v in adv_stats.items()})
    levels = np.asarray([exp.levels[r] for r in rows])
    for lvl in np.unique(levels):
        row[f"pass_rate/level_{int(lvl)}"] = float(correct[levels == lvl].mean())
    row["bin_counts"] = np.bincount(bins, minlength=exp.num_bins).tolist()
    if cfg.algorithm.dynamic_sampling:
        row["dynamic_sampling/rounds"] = len(rounds)
        row["dynamic_sampling/informative_groups"] = int(
            sum(int(x.informative.sum()) for x in rounds)
        )
        row["dynamic_sampling/kept_informative"] = int(rd.informative.sum())  # of P in the batch
    row.update(diagnostics)
    row.update({f"time/{k}": v for k, v in times.items()})
    row["time/step"] = sum(times.values())
    row["tokens_per_s/generate"] = completion_tokens_total / max(times["generate"], 1e-9)
    return state, ctrl, row


# ----------------------------------------------------------------------------- the job


class _Preempted:
    """SIGTERM -> finish the current step, checkpoint, exit 0."""

    def __init__(self):
        self.flag = False
        self._old = None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread (e.g. a notebook worker): no handler
            self._old = None
        return self

    def _handle(self, signum, frame):
        del signum, frame
        self.flag = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def _jit_functions(exp: Experiment) -> dict:
    algo = exp.config.algorithm
    P = exp.config.rollout.prompts_per_step
    fns = {
        "generate": sharding.under_mesh(exp.mesh, sampling.generate),
        "advantages": jax.jit(
            functools.partial(
                advantages_lib.compute,
                num_segments=P,
                estimator=algo.estimator,
                std=algo.std,
                clip=algo.advantage_clip or None,
                nonfinite="mask",
            )
        ),
        "logprobs": make_logprobs_fn(exp),
        "update": make_update_fn(exp),
        "take": make_take_fn(exp),
        "concat": make_concat_fn(exp),
    }
    if algo.name == "ppo":
        fns["ppo_advantages"] = make_ppo_advantages_fn(exp)
    return fns


def make_ppo_advantages_fn(exp: Experiment):
    """PPO baseline: critic values, outcome reward on the last token, GAE, whitening."""
    cfg = exp.config.algorithm
    lp = exp.prompt_len

    def fn(critic_params, batch: Batch, rewards):
        critic = nnx.merge(exp.critic_graphdef, critic_params)
        positions = positions_from_mask(batch.attention_mask)
        values = critic(batch.tokens[:, :-1], positions[:, :-1], batch.attention_mask[:, :-1])
        values = values[:, lp - 1 :] * batch.completion_mask
        last = jnp.maximum(batch.completion_mask.sum(-1).astype(jnp.int32) - 1, 0)
        token_rewards = jnp.zeros_like(values).at[jnp.arange(values.shape[0]), last].set(rewards)
        if cfg.kl_coef > 0:
            token_rewards = token_rewards - cfg.kl_coef * (batch.old_logprobs - batch.ref_logprobs)
        adv, returns = losses.gae(
            token_rewards, values, batch.completion_mask, gamma=cfg.ppo_gamma, lam=cfg.ppo_lam
        )
        adv = losses.whiten(adv, batch.completion_mask)
        return batch.replace(advantages=adv, returns=returns, old_values=values)

    return jax.jit(sharding.under_mesh(exp.mesh, fn))


def supervised_warmstart(exp: Experiment, params, rng) -> tuple[Any, dict]:
    """Short supervised fine-tuning on (prompt, gold answer) pairs before RL.

    Used by the embedded default so RL starts from a policy that knows the answer format
    (a model at 0% reward gets no GRPO signal). Returns (params, metrics).
    """
    cfg = exp.config.sft
    tokens, mask, target_mask = exp.sft_data()
    n = tokens.shape[0]
    tx = optax.adamw(cfg.learning_rate, b1=0.9, b2=0.99, weight_decay=0.0)
    opt_state = tx.init(params)
    graphdef = exp.graphdef

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tok, msk, tmask):
        def loss_fn(p):
            model = nnx.merge(graphdef, p)
            logits, _ = model(tok[:, :-1], positions_from_mask(msk)[:, :-1], msk[:, :-1])
            lp = losses.logprobs_from_logits(logits, tok[:, 1:])
            m = tmask[:, 1:]
            return -(lp * m).sum() / jnp.maximum(m.sum(), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    gen = np.random.default_rng(exp.config.seed + 1)
    t0 = time.perf_counter()
    loss = float("nan")
    for _ in range(cfg.steps):
        idx = gen.choice(n, size=cfg.batch_size, replace=n < cfg.batch_size)
        params, opt_state, loss = step(
            params,
            opt_state,
            jnp.asarray(tokens[idx]),
            jnp.asarray(mask[idx]),
            jnp.asarray(target_mask[idx]),
        )
    return params, {
        "sft_loss": float(loss),
        "sft_seconds": time.perf_counter() - t0,
        "sft_steps": cfg.steps,
    }


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Runs (or resumes) the experiment described by ``config`` in ``workdir``.

    Writes ``metrics.jsonl``, TensorBoard events, Orbax checkpoints and ``summary.json`` into
    ``workdir``; returns the summary dict.

    Raises:
      config_utils.ConfigError: invalid or incompatible configuration (one-line message).
    """
    config_utils.validate(config)
    os.makedirs(workdir, exist_ok=True)
    config_path = os.path.join(workdir, "config.json")
    new_workdir = not os.path.exists(config_path)
    config_utils.check_workdir(config, workdir)
    wall0 = time.perf_counter()
    try:
        exp = build_experiment(config)
    except (ValueError, FileNotFoundError) as e:  # bad paths, data or values: one line for the CLI
        if new_workdir and jax.process_index() == 0 and os.path.exists(config_path):
            os.remove(
                config_path
            )  # nothing ran: the corrected command must not be refused as "another run"
        if isinstance(e, config_utils.ConfigError):
            raise
        raise config_utils.ConfigError(" ".join(str(e).split())) from e
    ckpt = checkpointing.Checkpointer(
        os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep
    )
    source = exp.make_source()

    # Initial state (shape first, then materialised directly into its sharding).
    state = exp.init_state(make_state=TrainState)
    fns = _jit_functions(exp)
    ctrl = init_controllers(exp)
    meta: dict = {}
    restored = ckpt.restore_latest(
        checkpointing.abstract_like(
            {"train": state, "controllers": ctrl, "ref_params": exp.ref_params_or_none(state)}
        )
    )
    if restored is not None:
        step, tree, meta = restored
        state, ctrl = tree["train"], tree["controllers"]
        exp.set_ref_params(tree["ref_params"], state)
        source.set_state(meta["data"])
        print(f"Resuming from checkpoint at step {step} in {ckpt.directory}", flush=True)
    else:
        sft_metrics = {}
        if config.sft.steps > 0:
            params, sft_metrics = supervised_warmstart(exp, state.params, state.rng)
            state = jax.device_put(
                state.replace(params=params, opt_state=exp.tx.init(params)), exp.state_shardings
            )
        exp.set_ref_params(None, state)
        eval_rng = jax.random.PRNGKey(config.seed + 7)
        meta = {
            "eval_before": evaluation.evaluate(exp, state.params, eval_rng),
            "sft": sft_metrics,
            "data": source.get_state(),
        }
        ckpt.save(
            0,
            {"train": state, "controllers": ctrl, "ref_params": exp.ref_params_or_none(state)},
            {**meta, "config": config.to_dict()},
        )
    writer = writers.MetricsWriter(
        workdir,
        tensorboard=config.logging.tensorboard,
        resume_step=int(state.step) + 1 if int(state.step) else 0,
    )  # row N precedes checkpoint N
    if (
        int(state.step) == 0
    ):  # (again after a restart at checkpoint 0: that row may not have been written)
        writer.write(
            0,
            {
                **{f"eval/{k}": v for k, v in writers.flatten(meta["eval_before"]).items()},
                **{f"data/{k}": v for k, v in exp.data_stats.items()},
            },
        )

    bar = None
    if config.logging.progress_bar and jax.process_index() == 0:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=config.steps,
            initial=int(state.step),
            desc=config.algorithm.name,
            dynamic_ncols=True,
        )
    preempted = False
    with _Preempted() as sigterm:
        while int(state.step) < config.steps:
            state, ctrl, row = rl_step(exp, state, ctrl, source, fns)
            step = int(state.step)
            if int(state.skips) >= config.optimizer.max_consecutive_skips:
                writer.write(
                    step, row
                )  # the failing step's row (loss, grad_norm) is part of the diagnosis
                ckpt.save(
                    step,
                    {
                        "train": state,
                        "controllers": ctrl,
                        "ref_params": exp.ref_params_or_none(state),
                    },
                    {**meta, "data": source.get_state(), "config": config.to_dict()},
                )
                raise FloatingPointError(
                    f"step {step}: {int(state.skips)} consecutive updates had a non-finite loss, gradient or "
                    f"update and were skipped; the last good parameters are checkpointed (step {step} in "
                    f"{ckpt.directory}). Likely causes: learning rate too "
                    "high (config.optimizer.learning_rate), bfloat16 overflow (config.model.dtype=float32), or "
                    "non-finite rewards."
                )
            if (
                config.eval.every_steps
                and step % config.eval.every_steps == 0
                and step < config.steps
            ):
                ev = evaluation.evaluate(exp, state.params, jax.random.PRNGKey(config.seed + 7))
                row.update({f"eval/{k}": v for k, v in writers.flatten(ev).items()})
            if step % config.logging.every_steps == 0:
                writer.write(step, row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(
                    reward=f"{row['reward_mean']:.3f}",
                    pass_rate=f"{row['pass_rate']:.3f}",
                    tok_s=f"{row['tokens_per_s/generate']:.0f}",
                )
            if sigterm.flag or step % config.checkpoint.every_steps == 0 or step == config.steps:
                ckpt.save(
                    step,
                    {
                        "train": state,
                        "controllers": ctrl,
                        "ref_params": exp.ref_params_or_none(state),
                    },
                    {**meta, "data": source.get_state(), "config": config.to_dict()},
                )
            if sigterm.flag:
                preempted = True
                print(f"SIGTERM: checkpoint written at step {step}; exiting.", flush=True)
                break
    if bar is not None:
        bar.close()
    writer.close()
    if preempted:
        exp.close()
        ckpt.close()
        return {"preempted": True, "step": int(state.step)}

    eval_after = evaluation.evaluate(exp, state.params, jax.random.PRNGKey(config.seed + 7))
    summary = {
        "algorithm": config.algorithm.name,
        "steps": int(state.step),
        "wall_seconds": time.perf_counter() - wall0,
        "eval_before": meta["eval_before"],
        "eval_after": eval_after,
        "sft": meta.get("sft", {}),
        "data": exp.data_stats,
    }
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(writers.to_jsonable(summary), f, indent=2, sort_keys=True)
        print(evaluation.format_summary(summary), flush=True)
    exp.close()
    ckpt.close()
    return summary
