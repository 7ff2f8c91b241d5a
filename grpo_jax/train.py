"""The RL loop, top to bottom: `train_and_evaluate(config, workdir)` and one step, `rl_step`.

`experiments/run.py` is a thin absl wrapper around `train_and_evaluate`; notebooks call it
directly. The algorithm (``config.algorithm.name``) is a registered curriculum + learner
(`grpo_jax.algorithms`); the step below calls their hooks and never branches on the name:

  1. draw P prompts                          curriculum.draw      (host: example dicts)
  2. bins and rollouts per prompt            curriculum.allocate  (R = P * n_bar fixed)
  3. generate R completions                  steps.generate       (device)
  4. score them                              reward_fn            (host, worker processes)
     [DAPO dynamic sampling: more rounds of 1-4 until P groups have unequal rewards]
  5. group advantages + per-rollout weights  steps.advantages (device), curriculum.weights (host)
  6. reference / old log-probs               steps.logprobs       (device; skipped if unused)
  7. num_iterations x mini-batch updates     steps.train          (device, one program)
  8. the curriculum learns from the step     curriculum.update    (classifier, controllers)
  9. one metrics row; checkpoint on schedule or on a signal

A SIGTERM / SIGINT stops the job at the next safe point (`grpo_jax.preemption`).

With ``config.rollout.max_staleness`` = k >= 1 (rollouts in flight, `grpo_jax.rollout_queue`)
steps 1-3 run for the batch of step t + k, from the current parameters, and steps 4-9 for the
oldest batch in flight, generated at step t - k (`_sample_in_flight`).

Host <-> device: prompts go up once per sampler call (step 3), completions come down once
(step 4, to be detokenised and verified), and the step's metrics come down in one transfer
(step 9). The curriculum's controllers are small arrays updated eagerly on the host's device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from grpo_jax import (
    algorithms,
    checkpointing,
    config_schema,
    config_utils,
    divergence,
    evaluation,
    gdro,
    preemption,
    rollout_queue,
    sampling,
    sharding,
    steps,
    writers,
)
from grpo_jax import rewards as rewards_lib
from grpo_jax import transfer as xfer
from grpo_jax.envs import episodes
from grpo_jax.errors import ConfigError
from grpo_jax.experiment import Experiment, build_experiment
from grpo_jax.rewards import failures as rewards_failures
from grpo_jax.rewards import from_config as reward_from_config
from grpo_jax.state import Batch, RunState


@dataclasses.dataclass(frozen=True)
class Round:
    """One sampling round (steps 1-4 of `rl_step`): P prompts and their R rollouts.

    Host arrays: ids [P] int32, rows [R] (prompt id of each rollout), rewards [R] float32,
    correct [R] bool, lengths [R] int32, informative [P] bool (the group's rewards are not all
    equal), kept [P] bool (a group-filtering step keeps the group: `Curriculum.keep_groups`;
    ``informative`` otherwise). Device arrays: rollouts (`sampling.Rollouts`, [R, ...]),
    prompt_mask [R, Lp] bool.
    decode_utilisation: share of decode slot-steps that did work (continuous batching only).
    reward_errors: failure kind -> its first text in the round (the reward's ``errors`` stat).
    version: with rollouts in flight (``rollout.max_staleness`` >= 1) ``{"policy_version": the
    updates the sampling parameters had seen, "staleness": the training step minus that}``, in
    the metrics row and every sample; empty otherwise.
    """

    ids: np.ndarray
    placement: algorithms.Placement
    rows: np.ndarray
    rollouts: Any
    prompt_mask: Any
    rewards: np.ndarray
    correct: np.ndarray
    lengths: np.ndarray
    informative: np.ndarray
    kept: np.ndarray
    reward_stats: dict
    times: dict
    texts: tuple = ()
    decode_utilisation: float | None = None  # continuous batching's SlotStats.utilisation
    reward_errors: dict = dataclasses.field(default_factory=dict)
    version: dict = dataclasses.field(default_factory=dict)  # policy_version, staleness
    env_stats: dict = dataclasses.field(default_factory=dict)  # episodes' turns, tool calls

    @property
    def visit(self) -> algorithms.Visit:
        return algorithms.Visit(self.ids, self.correct, self.placement.segment_ids)


# key derivations as device programs (an eager one would send its constants to the device)
_split_keys = jax.jit(lambda key, n: tuple(jax.random.split(key, n)), static_argnums=1)
_fold_in = jax.jit(jax.random.fold_in, static_argnums=1)


def _timer():
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


def filters_groups(exp: Experiment) -> bool:
    """Whether a step keeps only the groups its curriculum accepts and samples more rounds
    (``config.algorithm.dynamic_sampling`` or a curriculum with ``filters_groups``)."""
    return bool(exp.run.algorithm.dynamic_sampling or exp.curriculum.filters_groups)


def sample_round(exp: Experiment, fns: steps.Steps, run: RunState, source, key) -> Round:
    """Steps 1-4: draw, classify and allocate, generate, reward."""
    times = {}
    gen = dispatch_round(exp, fns, run, source, key, int(run.train.step), times)
    return score_round(exp, run, gen, times)


def dispatch_round(
    exp: Experiment, fns: steps.Steps, run: RunState, source, key, step: int, times: dict
) -> rollout_queue.Generated:
    """Steps 1-3 for the batch step ``step`` trains on: draw, classify and allocate
    (`decide_round`), then the sampler's calls from ``run``'s parameters (dispatched; nothing
    waits for them). Sets the seconds of each phase in ``times["prepare"]`` /
    ``times["generate"]``."""
    gen = decide_round(exp, run, source, step, times)
    rows = gen.ids[gen.placement.segment_ids]
    t = _timer()
    if exp.environment is None:
        (rollouts, util), episode = dispatch_samples(exp, fns, run.train.params, rows, key), None
    else:  # multi-turn episodes run their turns here, on the host (max_staleness 0 only)
        (rollouts, episode), util = _episodes(exp, fns, run, rows, key), []
    times["generate"] = t()
    return gen.replace(
        rollouts=rollouts, utilisation=jnp.stack(util) if util else None, episodes=episode
    )


def decide_round(
    exp: Experiment, run: RunState, source, step: int, times: dict
) -> rollout_queue.Generated:
    """Steps 1-2 for the batch step ``step`` trains on: draw, classify and allocate with
    ``run``'s controllers. Returns a `Generated` of host bookkeeping (version: ``run``'s step)
    with no rollouts yet; sets ``times["prepare"]``. The two-group run sends its rows to the
    generation group instead of sampling here (`grpo_jax.disaggregated`)."""
    t = _timer()
    cur = exp.curriculum
    prompts = cur.draw(run.controllers, source, step)
    ids = np.asarray([p["id"] for p in prompts], np.int32)
    placement = cur.allocate(run.controllers, ids)
    times["prepare"] = t()
    return rollout_queue.Generated(
        version=np.int32(int(run.train.step)), ids=ids, placement=placement, rollouts=None
    )


def score_round(
    exp: Experiment, run: RunState, gen: rollout_queue.Generated, times: dict, version=None
) -> Round:
    """Step 4: the completions of ``gen`` (host bookkeeping) to the host, detokenised and scored
    (the curriculum's ``keep_groups`` with ``run``'s controllers). ``times``: the seconds of
    `dispatch_round`'s phases, to which the wait for the completions is added. ``version``: the
    row's ``policy_version`` / ``staleness`` fields (rollouts in flight only)."""
    cur, placement, ids = exp.curriculum, gen.placement, gen.ids
    rows = ids[placement.segment_ids]
    t = _timer()
    rollouts = gen.rollouts
    completions, lengths, util = xfer.to_host(
        (rollouts.completion_tokens, rollouts.lengths, gen.utilisation)
    )
    times = {**times, "generate": times["generate"] + t()}

    t = _timer()
    if gen.episodes is None:
        texts = scored = xfer.decode_completions(exp.tokenizer, completions, lengths)
    else:  # the whole episode to read; the reward scores what the environment says
        texts, scored = gen.episodes.texts, gen.episodes.scored
    rewards, correct, reward_stats = exp.score(scored, rows)
    reward_stats = dict(reward_stats)
    reward_errors = reward_stats.pop("errors", {})
    rewards, correct = np.asarray(rewards, np.float32), np.asarray(correct, bool)
    seg, P = placement.segment_ids, len(ids)
    hi, lo = np.full(P, -np.inf, np.float32), np.full(P, np.inf, np.float32)
    np.maximum.at(hi, seg, rewards)
    np.minimum.at(lo, seg, rewards)
    informative = hi > lo
    kept = (
        np.asarray(cur.keep_groups(run.controllers, ids, rewards, correct, seg), bool)
        if filters_groups(exp)
        else informative
    )
    times["reward"] = t()
    return Round(
        ids=ids,
        placement=placement,
        rows=rows,
        rollouts=rollouts,
        prompt_mask=xfer.to_device(exp.mesh, exp.pool.mask[rows]),
        rewards=rewards,
        correct=correct,
        lengths=np.asarray(lengths),
        informative=informative,
        kept=kept,
        reward_stats=reward_stats,
        times=times,
        texts=tuple(texts),
        decode_utilisation=float(np.mean(util)) if util is not None else None,
        reward_errors=reward_errors,
        version=version or {},
        env_stats=gen.episodes.stats if gen.episodes else {},
    )


def dispatch_samples(exp: Experiment, fns: steps.Steps, params, rows, key):
    """One completion per rollout of the pool's ``rows`` [R] int32, sampled from ``params``
    (the training layout) with ``key``; the sampler's calls dispatched (nothing waits).
    Returns (rollouts [R, ...], the calls' decode utilisations: device scalars of continuous
    batching, else empty)."""
    R, gbs = len(rows), exp.batching.generate_batch_size
    keys = [key] if gbs >= R else _split_keys(key, R // gbs)
    params = fns.to_generation(params)  # the sampler's layout, once per round
    parts = [
        fns.generate(
            params,
            xfer.to_device(exp.mesh, exp.pool.tokens[rows[s : s + gbs]]),
            xfer.to_device(exp.mesh, exp.pool.mask[rows[s : s + gbs]]),
            k,
        )
        for k, s in zip(keys, range(0, R, gbs))
    ]
    util = [p.decode_utilisation for p in parts if p.decode_utilisation is not None]
    parts = [p.replace(decode_utilisation=None) for p in parts]
    return (parts[0] if len(parts) == 1 else fns.concat(parts)), util


def _episodes(exp: Experiment, fns: steps.Steps, run: RunState, rows, key):
    """Multi-turn episodes of ``exp.environment`` (`grpo_jax.envs.episodes`), every rollout in
    one sampler call per turn: (rollouts with the policy's tokens as ``loss_mask``, the
    `rollout_queue.EpisodeTexts`: each episode's text, the texts scored
    (`Environment.final_text`), turn and tool-call sums)."""
    dev = lambda x: xfer.to_device(exp.mesh, x)
    prompts = exp.pool.tokens[rows]
    ep = episodes.run_episodes(
        lambda tokens, mask, k, caps: fns.generate_turn(
            run.train.params, dev(tokens), dev(mask), k, dev(caps)
        ),
        exp.tokenizer,
        exp.environment,
        prompts,
        exp.pool.mask[rows],
        [exp.pool.examples[r] for r in rows],
        key,
        budget=exp.max_new_tokens,
        turn_tokens=exp.turn_sampling.max_new_tokens,
    )
    rollouts = sampling.Rollouts(
        tokens=dev(np.concatenate([prompts, ep.completion_tokens], axis=1)),
        completion_tokens=dev(ep.completion_tokens),
        completion_mask=dev(ep.present_mask),
        logprobs=dev(ep.logprobs),
        lengths=dev(ep.lengths),
        truncated=dev(ep.truncated),
        loss_mask=dev(ep.policy_mask),
    )
    texts = xfer.decode_completions(exp.tokenizer, ep.completion_tokens, ep.lengths)
    stats = {"turns": int(ep.turns.sum()), "tool_calls": int(ep.tool_calls.sum())}
    return rollouts, rollout_queue.EpisodeTexts(tuple(texts), tuple(ep.texts), stats)


def keep_informative_groups(exp: Experiment, fns: steps.Steps, rounds: list[Round]) -> Round:
    """DAPO dynamic sampling (Yu et al. 2025, Eq. 11) and its relatives: a batch of P groups of
    the same size, the kept groups first (``Round.kept``: DAPO's are those with unequal rewards;
    in the order they were sampled); when the rounds ran out before P such groups were found,
    the rest is filled with the others (DAPO's have zero advantage, so they add only the KL
    term), keeping every shape fixed. Needs a fixed group size.
    """
    P, n = exp.run.rollout.prompts_per_step, exp.run.rollout.rollouts_per_prompt
    R = exp.batching.rollouts_per_step
    order = [(r, g) for r, x in enumerate(rounds) for g in np.flatnonzero(x.kept)]
    order += [(r, g) for r, x in enumerate(rounds) for g in np.flatnonzero(~x.kept)]
    chosen = order[:P]
    src = np.concatenate([r * R + g * n + np.arange(n) for r, g in chosen])  # rows of the rounds
    cat = lambda f: np.concatenate([f(x) for x in rounds])[src]
    bins = np.asarray([rounds[r].placement.bins[g] for r, g in chosen], np.int32)
    placement = algorithms.Placement(
        bins=bins,
        success=rounds[0].placement.success,
        allocation=gdro.fixed_allocation(bins, n, exp.num_bins),
    )
    rollouts, prompt_mask = fns.take(
        fns.concat([(x.rollouts, x.prompt_mask) for x in rounds]),
        xfer.to_device(exp.mesh, src.astype(np.int32)),
    )
    return Round(
        ids=np.asarray([rounds[r].ids[g] for r, g in chosen], np.int32),
        placement=placement,
        rows=cat(lambda x: x.rows),
        rollouts=rollouts,
        prompt_mask=prompt_mask,
        rewards=cat(lambda x: x.rewards),
        correct=cat(lambda x: x.correct),
        lengths=cat(lambda x: x.lengths),
        informative=np.asarray([rounds[r].informative[g] for r, g in chosen]),
        kept=np.asarray([rounds[r].kept[g] for r, g in chosen]),
        reward_stats={},
        times={},
    )


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one RL step did (`rl_step`).

    Attributes:
      run: the run state after the step.
      row: the step's metrics row (``samples``: a few completions to read).
      rounds: one ``(ids [P] int32, placement)`` per sampling round (DAPO dynamic sampling
        draws several): which prompts were drawn, their bins and rollouts per prompt.
      outcome: what the curriculum learned from (`algorithms.StepOutcome` of the trained batch).
      reward_failures: ``{"failed", "scored", "errors"}``: rollouts of every round whose reward
        failed (crashed or timed out) of those scored, and failure kind -> its first text.
      batch_ids: [P] int32, the prompts of the trained batch (the kept groups when several
        rounds were drawn; the only round's ids otherwise).
    """

    run: RunState
    row: dict
    rounds: tuple
    outcome: algorithms.StepOutcome
    reward_failures: dict = dataclasses.field(default_factory=dict)
    batch_ids: np.ndarray | None = None


def _sample(exp: Experiment, fns: steps.Steps, run: RunState, source, key) -> list[Round]:
    """Steps 1-4: one round; with group filtering (`filters_groups`: DAPO dynamic
    sampling and its relatives), more rounds until P groups are kept (at most 1 +
    ``dynamic_sampling_max_rounds``)."""
    rounds = [sample_round(exp, fns, run, source, key)]
    algo, P = exp.run.algorithm, exp.run.rollout.prompts_per_step
    if filters_groups(exp):
        for r in range(algo.dynamic_sampling_max_rounds):
            if sum(int(x.kept.sum()) for x in rounds) >= P:
                break
            rounds.append(sample_round(exp, fns, run, source, _fold_in(key, r + 1)))
    return rounds


def fill_in_flight(exp: Experiment, fns: steps.Steps, run: RunState, source) -> RunState:
    """``run`` with its rollouts in flight (``rollout.max_staleness`` = k >= 1; unchanged when k
    is 0 or they are there): the k batches steps t .. t + k - 1 train on, generated from the
    current parameters (a run's start: `train_and_evaluate` before its first checkpoint)."""
    k, t = exp.run.rollout.max_staleness, int(run.train.step)
    if not k or run.in_flight is not None:
        return run
    keys = [rollout_queue.fill_key(run.train.rng, i) for i in range(k)]
    gens = [dispatch_round(exp, fns, run, source, key, t + i, {}) for i, key in enumerate(keys)]
    return run.replace(in_flight=tuple(rollout_queue.park(exp.mesh, g) for g in gens))


def _sample_in_flight(exp: Experiment, fns: steps.Steps, run: RunState, source, key):
    """Steps 1-4 with rollouts in flight (``rollout.max_staleness`` = k >= 1): the generation of
    the batch for step t + k is dispatched from the current parameters, then the oldest batch in
    flight (generated at step t - k, or before step 0) is scored on the host while the device
    generates. Returns ([its Round], the batches in flight after the step)."""
    run, times, t = fill_in_flight(exp, fns, run, source), {}, int(run.train.step)
    new = dispatch_round(exp, fns, run, source, key, t + exp.run.rollout.max_staleness, times)
    oldest = rollout_queue.unpark(run.in_flight[0])
    version = {"policy_version": int(oldest.version), "staleness": t - int(oldest.version)}
    in_flight = (*run.in_flight[1:], rollout_queue.park(exp.mesh, new))
    return [score_round(exp, run, oldest, times, version)], in_flight


def _batch(exp: Experiment, fns: steps.Steps, run: RunState, rd: Round):
    """Steps 5-6: advantages, the curriculum's weights, reference and old log-probs.

    Returns: (the learner's batch, advantages [R] on device and on the host, advantage stats,
    weights [R], the attention mask on the host when the update is packed, else None)."""
    ro = rd.rollouts
    rewards, seg = (xfer.to_device(exp.mesh, x) for x in (rd.rewards, rd.placement.segment_ids))
    rewards = fns.shape_rewards(rewards, ro.lengths)
    adv, adv_stats = fns.advantages(rewards, seg)
    attention_mask, loss_mask = fns.masks(
        rd.prompt_mask, ro.completion_mask, ro.truncated, ro.loss_mask
    )
    # the sampling policy's log-probs: off-policy the update's ratio needs them; on-policy the
    # update uses its own (detached) log-probs and only a learner that reads them gets them (PPO's
    # KL reward penalty); a field nobody reads is None, never a placeholder
    needs_old = not exp.batching.on_policy or exp.learner.needs_policy_logprobs
    # the packed passes (`config.algorithm.pack_sequences`) are planned on the host
    mask_host = xfer.to_host(attention_mask) if exp.batching.pack_sequences else None
    plan = None
    if mask_host is not None and (needs_old or exp.uses_reference):
        plan = xfer.replicate(exp.mesh, steps.packed_logprob_plan(exp, mask_host))
    logprobs = lambda params: fns.logprobs(params, ro.tokens, attention_mask, plan)
    old_logprobs = logprobs(run.train.params) if needs_old else None
    ref_logprobs = logprobs(run.ref_params) if exp.uses_reference else None
    # the curriculum's weights: host bookkeeping from the host advantages (the log-prob passes
    # above are already dispatched), then onto the batch's layout
    adv_host = xfer.to_host(adv)
    weights = exp.curriculum.weights(run.controllers, rd.placement, adv_host)
    weights = xfer.to_device(exp.mesh, np.asarray(weights, np.float32))
    batch = Batch(
        tokens=ro.tokens,
        attention_mask=attention_mask,
        completion_mask=loss_mask,
        advantages=adv,
        sample_weights=weights,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        sampler_logprobs=ro.logprobs,
    )
    batch = fns.finish_batch(run.train, batch, rewards)
    return batch, adv, adv_host, adv_stats, weights, mask_host


_increment = jax.jit(lambda x: x + 1)


@jax.jit
def _step_keys(rng: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(next run key, the step's sampling key, its mini-batch shuffle key) on device."""
    rng, gen_key = jax.random.split(rng)
    return rng, gen_key, jax.random.fold_in(gen_key, 0x5EED)


def rl_step(
    exp: Experiment, fns: steps.Steps, run: RunState, source, sample_in_flight=None
) -> StepResult:
    """One RL step (see the module docstring): sample, score, update, let the curriculum
    learn. Returns the `StepResult` (new run state, metrics row, placements, outcome).

    ``sample_in_flight``: steps 1-4 with rollouts in flight, ``(exp, fns, run, source, key) ->
    ([Round], the run state's batches in flight after the step)``; default
    `_sample_in_flight` (this process generates). The two-group run passes
    `grpo_jax.disaggregated.GenerationGroup.sample` (the generation group generates)."""
    rng, gen_key, order_key = _step_keys(run.train.rng)

    # 1-4. prompts -> bins -> allocation -> R rollouts -> rewards
    if exp.run.rollout.max_staleness:  # rollouts in flight: trains on an older batch
        rounds, in_flight = (sample_in_flight or _sample_in_flight)(exp, fns, run, source, gen_key)
    else:
        rounds, in_flight = _sample(exp, fns, run, source, gen_key), None
    rd = rounds[0] if len(rounds) == 1 else keep_informative_groups(exp, fns, rounds)
    times = {k: sum(x.times[k] for x in rounds) for k in ("prepare", "generate", "reward")}

    # 5-6. the batch
    t = _timer()
    batch, adv, adv_host, adv_stats, weights, mask_host = _batch(exp, fns, run, rd)
    jax.block_until_ready(batch)
    times["reference"] = t()

    # 7. the updates: num_iterations passes of mini-batches, on device.
    t = _timer()
    plan = ()
    if mask_host is not None:  # packed: the same mini-batches, planned on the host
        rows = xfer.to_host(fns.minibatch_order(order_key))
        plan = (xfer.replicate(exp.mesh, steps.packed_step_plan(exp, mask_host, rows)),)
    state, upd = fns.train(run.train, batch, order_key, *plan)
    truncated = rd.rollouts.truncated.astype(jnp.float32)
    summary = {
        "advantage_abs_mean": jnp.mean(jnp.abs(adv)),
        "sample_weight_max": jnp.max(weights),
        "truncated_fraction": jnp.mean(truncated),
        # token-mean -log pi(a_t) of the sampled tokens under the sampler (log_softmax(logits /
        # temperature)): the Monte-Carlo estimate of the sampling policy's per-token entropy
        "entropy": -jnp.sum(rd.rollouts.logprobs) / jnp.sum(_sampled(rd.rollouts)),
        "consecutive_skips": state.skips,
    }
    upd, adv_stats, summary = xfer.to_host((upd, adv_stats, summary))  # one read
    times["update"] = t()

    # 8. the curriculum learns from the step (every round's visits count, dropped groups too).
    t = _timer()
    outcome = algorithms.StepOutcome(
        placement=rd.placement,
        rewards=rd.rewards,
        correct=rd.correct,
        per_rollout_loss=np.asarray(upd.pop("per_rollout_loss")),
        advantages=adv_host,
        visits=tuple(x.visit for x in rounds),
    )
    controllers, diagnostics = exp.curriculum.update(run.controllers, outcome)
    state = state.replace(
        step=jax.device_put(_increment(state.step), state.step.sharding),
        rng=jax.device_put(rng, state.rng.sharding),
    )
    times["controllers"] = t()

    # 9. the metrics row.
    summary["advantages"] = adv_stats
    row = _metrics_row(exp, rounds, rd, upd, summary, diagnostics, times)
    new_run = RunState(state, controllers, run.ref_params, in_flight)
    placements = tuple((x.ids, x.placement) for x in rounds)
    return StepResult(
        run=new_run,
        row=row,
        rounds=placements,
        outcome=outcome,
        reward_failures=_reward_failures(rounds),
        batch_ids=np.asarray(rd.ids),
    )


def _reward_failures(rounds) -> dict:
    """`StepResult.reward_failures` of a step's sampling rounds."""
    errors = {}
    for x in rounds:
        for kind, text in x.reward_errors.items():
            errors.setdefault(kind, text)
    return {
        "failed": sum(
            int(x.reward_stats.get("num_crashes", 0)) + int(x.reward_stats.get("num_timeouts", 0))
            for x in rounds
        ),
        "scored": sum(len(x.rewards) for x in rounds),
        "errors": errors,
    }


def _reward_spread(rewards: np.ndarray, segment_ids: np.ndarray, num_groups: int) -> dict:
    """``reward_std``: the population std of the batch's rewards [R]; ``reward_group_std``: the
    mean over the ``num_groups`` groups (``segment_ids`` [R]) of each group's population std
    (0 when a group's rewards are equal: no GRPO signal; TRL's ``reward_std`` is this with
    the unbiased std)."""
    counts = np.maximum(np.bincount(segment_ids, minlength=num_groups), 1)
    mean = np.bincount(segment_ids, rewards, num_groups) / counts
    var = np.bincount(segment_ids, (rewards - mean[segment_ids]) ** 2, num_groups) / counts
    return {"reward_std": float(rewards.std()), "reward_group_std": float(np.sqrt(var).mean())}


def _sampled(ro: sampling.Rollouts) -> jax.Array:
    """[R, Lc] the tokens the sampler drew (a multi-turn episode's policy turns)."""
    return ro.completion_mask if ro.loss_mask is None else ro.loss_mask


def _metrics_row(exp: Experiment, rounds, rd: Round, upd, summary, diagnostics, times) -> dict:
    """Step 9: the step's metrics row from its rounds, trained batch ``rd``, the update's host
    metrics ``upd`` (its ``skipped_updates`` popped) and the curriculum's ``diagnostics``."""
    cfg, P = exp.run, exp.run.rollout.prompts_per_step
    generated = int(sum(int(x.lengths.sum()) for x in rounds))  # every round's compute
    any_correct = np.zeros(P, bool)
    np.logical_or.at(any_correct, rd.placement.segment_ids, rd.correct)
    row = {
        "reward_mean": float(rd.rewards.mean()),
        **_reward_spread(rd.rewards, rd.placement.segment_ids, P),
        "pass_rate": float(rd.correct.mean()),
        "any_correct_rate": float(any_correct.mean()),
        "completion_length": float(rd.lengths.mean()),
        "truncated_fraction": float(summary["truncated_fraction"]),
        "entropy": float(summary["entropy"]),
        "advantage_abs_mean": float(summary["advantage_abs_mean"]),
        "sample_weight_max": float(summary["sample_weight_max"]),
        "skipped_updates": int(upd.pop("skipped_updates")),
        "consecutive_skips": int(summary["consecutive_skips"]),
        "generated_tokens": generated,
        "generated_rollouts": int(sum(len(x.rows) for x in rounds)),  # every round's rollouts
        **{k: float(v) for k, v in upd.items()},
    }
    row.update(rewards_lib.metrics_fields([x.reward_stats for x in rounds]))
    row.update({f"advantages/{k}": int(v) for k, v in summary["advantages"].items()})
    levels = np.asarray([exp.pool.levels[r] for r in rd.rows])
    for lvl in np.unique(levels):
        row[f"pass_rate/level_{int(lvl)}"] = float(rd.correct[levels == lvl].mean())
    util = [x.decode_utilisation for x in rounds if x.decode_utilisation is not None]
    if util:
        row["decode_utilisation"] = float(np.mean(util))
    if rounds[0].env_stats:  # multi-turn episodes: per episode, over every round
        n = sum(len(x.rows) for x in rounds)
        for k in rounds[0].env_stats:
            row[f"env/{k}_mean"] = sum(x.env_stats[k] for x in rounds) / n
    # prompts per bin; the last entry counts never-seen prompts (their own state)
    row["bin_counts"] = np.bincount(rd.placement.bins, minlength=exp.num_bins + 1).tolist()
    if filters_groups(exp):
        row["dynamic_sampling/rounds"] = len(rounds)
        row["dynamic_sampling/informative_groups"] = int(sum(x.informative.sum() for x in rounds))
        row["dynamic_sampling/kept_informative"] = int(rd.informative.sum())  # of P in the batch
        row["dynamic_sampling/kept_groups"] = int(sum(x.kept.sum() for x in rounds))
    row.update(diagnostics)
    row.update(rd.version)  # rollouts in flight: the sampling policy's version
    row.update({f"time/{k}": v for k, v in times.items()})
    row["time/step"] = sum(times.values())
    first = rounds[0]  # a few completions to read (one per prompt): written to samples.jsonl
    picks = np.unique(first.placement.segment_ids, return_index=True)[1][: cfg.logging.num_samples]
    row["samples"] = [
        {
            "prompt": exp.pool.examples[first.rows[i]]["problem"],
            "completion": first.texts[i],
            "answer": exp.pool.golds[first.rows[i]],
            "reward": float(first.rewards[i]),
            **first.version,
        }
        for i in picks
    ]
    row["tokens_per_s/generate"] = generated / max(times["generate"], 1e-9)
    return row


def run_steps(
    exp: Experiment,
    fns: steps.Steps,
    run: RunState,
    source,
    *,
    until: int,
    hooks=(),
    sample_in_flight=None,
) -> tuple[RunState, bool]:
    """The RL loop: `rl_step` until ``run.train.step == until``.

    After each step every hook is called with its `StepResult`, in order; a hook that returns
    True stops the loop after that step (the others still see it); a hook may raise.
    ``sample_in_flight``: as for `rl_step`.

    Returns: (the last run state, whether a hook stopped the loop).
    """
    while int(run.train.step) < until:
        result = rl_step(exp, fns, run, source, sample_in_flight)
        run = result.run
        stop = False
        for hook in hooks:
            stop = bool(hook(result)) or stop
        if stop:
            return run, True
    return run, False


def restore_run(workdir: str, *, need_reward: bool = False, configure=None):
    """(experiment, restored RunState, step) of a workdir's latest checkpoint.

    ``configure(config)``, if given, edits the run's config before the build (evaluation
    settings; nothing that changes the checkpoint's shapes).

    ``need_reward=False`` builds the experiment with the built-in verifier in place of
    ``config.reward.fn`` / ``fns`` and without the reward model (exporting needs no reward, nor
    your reward module or reward-model files). The caller closes the experiment
    (``exp.close()``).
    """
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no run in {workdir}: {path} not found")
    with open(path) as f:
        config = config_schema.upgrade(json.load(f))
    if not need_reward:
        config.reward.fn, config.reward.fns, config.reward.model = "", (), ""
    if configure is not None:
        configure(config)
    exp = build_experiment(config)
    ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"))
    try:
        restored = ckpt.restore_latest(steps.abstract_run_state(exp))
    finally:
        ckpt.close()
    if restored is None:
        exp.close()
        raise FileNotFoundError(f"no checkpoint in {workdir}/checkpoints")
    return exp, restored[1], restored[0]


# ----------------------------------------------------------------------------- the job


_PENDING_EVAL = "pending_eval_row"  # meta key: a step whose evaluation a signal interrupted
_REWARD_FAILURES = "reward_failures"  # meta key: `rewards_failures.RewardFailures.state`
_DIVERGENCE = "divergence"  # meta key: `divergence.DivergenceWatch.state`


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(message, flush=True)


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    allow_changes=(),
    reward_callables=None,
    group=None,
) -> dict:
    """Runs (or resumes) the experiment described by ``config`` in ``workdir``.

    Writes ``metrics.jsonl``, TensorBoard events, Orbax checkpoints and ``summary.json`` into
    ``workdir``; returns the summary dict. One run per workdir (``<workdir>/.lock``).

    Args:
      allow_changes: dotted config fields (or sections) a resume may change although they
        change the trajectory (`config_utils.SAFE_TO_CHANGE` never need naming).
      reward_callables: ``{"callable:<name>": callable}`` for the entries of
        ``config.reward.fns`` that name Python callables (`grpo_jax.api.train`).
      group: the training group of a two-group run (`grpo_jax.disaggregated.Groups`): the
        mesh is built from its devices, the checkpoints span its processes, and the
        generation group generates the rollouts in flight. None: this job's every process
        trains and generates (today's run).

    Returns:
      the summary; ``{"preempted": True, "step": int | None, "signal": name}`` after SIGTERM or
      SIGINT (a consistent checkpoint, or none before the first one: rerunning reaches the
      same result as an uninterrupted run).

    Raises:
      errors.ConfigError: invalid or incompatible configuration (one-line message).
      checkpointing.WorkdirError: the workdir is a file, unwritable, or used by another run.
      checkpointing.CheckpointError: no readable checkpoint, or a save failed (the previous
        checkpoints intact).
      FloatingPointError: ``optimizer.max_consecutive_skips`` non-finite updates in a row (the
        last good state is checkpointed first); `DivergenceError` past
        ``optimizer.divergence_stop`` (that step checkpointed).
      rewards.failures.RewardFailureError: every rollout's reward failed in
        ``reward.max_failed_steps`` consecutive steps.
    """
    created = not os.path.exists(workdir)
    try:
        return _train_in(config, workdir, tuple(allow_changes), dict(reward_callables or {}), group)
    except ConfigError:
        if created and jax.process_index() == 0:
            _remove_unused(workdir)  # a refused new run leaves no workdir behind
        raise


def _remove_unused(workdir: str) -> None:
    """Removes a workdir that holds nothing but the released (empty) lock file."""
    lock = os.path.join(workdir, ".lock")
    with contextlib.suppress(OSError):
        if os.listdir(workdir) == [".lock"] and os.path.getsize(lock) == 0:
            os.remove(lock)
        os.rmdir(workdir)


def _train_in(config, workdir: str, allow_changes: tuple, callables: dict, group) -> dict:
    # the signal handler first: a signal during the checks or the lock only sets the flag (the
    # set-up then stops before any work), and the lock is released under it too
    with contextlib.ExitStack() as stack:
        # the processes that stop together: the training group (every process of a single run)
        sig = stack.enter_context(
            preemption.Preemption(group.processes if group is not None else None)
        )
        config_utils.validate(config)
        reward_from_config.check_functions(config, callables)
        checkpointing.probe_writable(workdir)
        if os.path.isdir(os.path.join(workdir, "checkpoints")):  # e.g. a read-only mount
            checkpointing.probe_writable(
                os.path.join(workdir, "checkpoints"), "checkpoint directory"
            )
        stack.enter_context(checkpointing.WorkdirLock(workdir))
        return _train(config, workdir, allow_changes, sig, stack, callables, group)


@dataclasses.dataclass
class _Job:
    """The pieces of a running job that its phases share (`_train`)."""

    config: ml_collections.ConfigDict
    workdir: str
    sig: preemption.Preemption
    exp: Experiment
    ckpt: checkpointing.Checkpointer
    source: Any
    fns: steps.Steps
    eval_rng: jax.Array
    meta: dict = dataclasses.field(default_factory=dict)
    reward_watch: rewards_failures.RewardFailures | None = None
    divergence: divergence.DivergenceWatch | None = None
    # time.perf_counter() when this process's part of the run began (`_train` sets it)
    wall0: float = dataclasses.field(default_factory=time.perf_counter)
    wall_before: float = 0.0  # seconds of the earlier parts, up to the checkpoint resumed from
    # the two-group run: the run state with its batches in flight received (`save` calls it)
    complete: Any = None

    def wall_seconds(self) -> float:
        """Seconds of the run so far, over every part (each up to its last checkpoint)."""
        return self.wall_before + time.perf_counter() - self.wall0

    def save(self, run: RunState, meta: dict | None = None) -> None:
        extra = {
            "data": self.source.get_state(),
            "config": self.config.to_dict(),
            "wall_seconds": self.wall_seconds(),
        }
        if self.complete is not None:
            run = self.complete(run)
        self.ckpt.save(int(run.train.step), run, {**(self.meta if meta is None else meta), **extra})

    def evaluate(self, run: RunState) -> dict:
        return evaluation.evaluate(self.exp, run.train.params, self.eval_rng)


def _start(
    config, workdir, allow_changes, sig, stack, progress: dict, new_workdir: bool, callables, group
):
    """Set-up, then the initial state: a checkpoint's arrays restored into the run's shapes
    and shardings, or (a new run) the initialisation, warm start and "before" evaluation.
    Returns (job, run state, restored?); raises `preemption.Interrupted` on a signal (nothing
    saved; ``progress["step"]``: the newest checkpoint's step while restoring, then the
    restored one's). ``new_workdir``: no config.json before this command, so a failed set-up
    removes the one it wrote.
    ``callables``: the Python API's reward callables, ``group``: the training group of a
    two-group run (`train_and_evaluate`)."""
    config_path = os.path.join(workdir, "config.json")  # written by check_workdir
    with sig.abortable():  # set-up, warm start, "before" evaluation: nothing on disk yet
        try:
            devices = group.devices if group is not None else None
            exp = build_experiment(config, rewards=callables, devices=devices)
            stack.callback(exp.close)
            _check_runnable(config, exp)
        except (ValueError, TypeError, FileNotFoundError) as e:  # bad paths, data, values
            if new_workdir and jax.process_index() == 0 and os.path.exists(config_path):
                os.remove(config_path)  # nothing ran: the corrected command must run
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(" ".join(str(e).split())) from None
        ckpt = checkpointing.Checkpointer(
            os.path.join(workdir, "checkpoints"),
            keep=config.checkpoint.keep,
            processes=group.processes if group is not None else None,
        )
        stack.callback(ckpt.close)
        job = _Job(
            config,
            workdir,
            sig,
            exp,
            ckpt,
            exp.make_source(),
            steps.make_steps(exp),
            jax.random.PRNGKey(config.seed + 7),
        )
        progress["step"] = max(ckpt.all_steps(), default=None)  # a signal now: "resuming"
        try:
            restored = ckpt.restore_latest(
                steps.abstract_run_state(exp), interrupted=lambda: sig.requested and sig.aborts
            )
        except Exception:
            if sig.requested and sig.aborts:  # the signal interrupted the read (nothing was
                # skipped or moved; several processes: never interrupted, see Preemption)
                raise preemption.Interrupted() from None
            raise
        if restored is None:
            run, sft_metrics = steps.init_run(exp)
            job.meta = {"eval_before": job.evaluate(run), "sft": sft_metrics}
            return job, run, False
        step, run, job.meta = restored
        job.wall_before = float(job.meta.pop("wall_seconds", 0.0))  # absent: an older checkpoint
        progress["step"] = step
        if "config" in job.meta:  # the copy that produced this state (also: fall-back steps)
            where = f"checkpoint {step} in {ckpt.directory}"
            config_utils.check_resume(
                job.meta["config"], config.to_dict(), where, allow_changes, what="a state"
            )
        job.source.set_state(job.meta["data"])
        # before any file is cut back to this step: no later start resumes from a newer one
        ckpt.set_aside_unreadable()
        # every process says it (multi-host launch logs are read per process)
        print(f"Resuming from checkpoint at step {step} in {ckpt.directory}", flush=True)
        return job, run, True


def _open_writer(job: _Job, step: int, pending, stack) -> writers.MetricsWriter:
    logs = job.exp.run.logging
    writer = writers.MetricsWriter(
        job.workdir,
        tensorboard=logs.tensorboard,
        # row N precedes checkpoint N; at step 0 that row may not have been written yet (nor
        # the row of a step whose evaluation was interrupted)
        resume_step=step if pending is not None else (step + 1 if step else 0),
        wandb={k: getattr(logs, f"wandb_{k}") for k in ("project", "entity", "mode", "name")},
        run_config=job.config.to_dict(),
    )
    stack.callback(writer.close)
    if step == 0:
        before = writers.flatten(job.meta["eval_before"])
        writer.write(
            0,
            {
                **{f"eval/{k}": v for k, v in before.items()},
                **{f"data/{k}": v for k, v in job.exp.pool.stats.items()},
            },
        )
    return writer


def _progress_bar(config, step: int, stack):
    if not config.logging.progress_bar or jax.process_index() != 0:
        return None

    from tqdm.auto import tqdm  # the notebook widget in notebooks: chosen when imported

    bar = tqdm(total=config.steps, initial=step, desc=config.algorithm.name, dynamic_ncols=True)
    stack.callback(bar.close)
    return bar


def _step_hooks(job: _Job, writer, bar, final_eval: dict):
    """The job's `run_steps` hooks: reward failures (`grpo_jax.rewards.failures`), the non-finite
    stop, finite divergence (`grpo_jax.divergence`), evaluation + samples + row + checkpoint.
    Also returns ``finish_step(run, row, saved)`` (True: a signal stops the run)."""
    config, sig = job.exp.run, job.sig  # the typed config: the loop's schedule

    def finish_step(run: RunState, row: dict, saved: bool) -> bool:
        step = int(run.train.step)
        every = config.eval.every_steps
        # the periodic evaluations, and the final one: it is the last step's row (curves and
        # TensorBoard end where the run ends) and the summary's eval_after
        if (every and step % every == 0) or step == config.steps:
            try:
                with sig.abortable():
                    ev = job.evaluate(run)
            except preemption.Interrupted:
                # keep the step; its evaluation and row are redone on resume
                preemption.quiesce()
                if not saved:
                    job.save(run, {**job.meta, _PENDING_EVAL: writers.to_jsonable(row)})
                _say(
                    f"{sig.name} during the evaluation after step {step}: checkpoint written "
                    f"at step {step} (the evaluation is redone on resume); exiting."
                )
                return True
            row.update({f"eval/{k}": v for k, v in writers.flatten(ev).items()})
            if step == config.steps:
                final_eval["eval_after"] = ev
        record(step, row, step % config.logging.every_steps == 0 or step == config.steps)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(
                reward=f"{row['reward_mean']:.3f}",
                pass_rate=f"{row['pass_rate']:.3f}",
                tok_s=f"{row['tokens_per_s/generate']:.0f}",
            )
        stop = sig.agree()  # several processes: any one's signal stops them all at this step
        if not saved and (
            stop or step % config.checkpoint.every_steps == 0 or step == config.steps
        ):
            job.save(run)
        if stop:
            _say(f"{sig.name}: checkpoint written at step {step}; exiting.")
            return True
        return False

    def record(step: int, row: dict, with_row: bool) -> None:
        # a step's samples and row are written together, after its evaluation and before its
        # checkpoint (a pending row keeps its samples): on resume both files are cut at one step
        writer.write_samples(step, row.pop("samples", []))
        if with_row:
            writer.write(step, row)

    def non_finite(result: StepResult) -> None:
        run, step = result.run, int(result.run.train.step)
        if int(run.train.skips) >= config.optimizer.max_consecutive_skips:
            record(step, result.row, True)  # the failing step's row (loss, grad_norm) is diagnosis
            job.save(run)
            raise FloatingPointError(
                f"step {step}: {int(run.train.skips)} consecutive updates had a non-finite "
                "loss, gradient or update and were skipped; the last good parameters are "
                f"checkpointed (step {step} in {job.ckpt.directory}). Likely causes: learning "
                "rate too high (config.optimizer.learning_rate), bfloat16 overflow "
                "(config.model.dtype=float32), or non-finite rewards."
            )

    def finish(result: StepResult) -> bool:
        return finish_step(result.run, result.row, saved=False)

    reward_failures, diverged = _watch_hooks(job, record)
    return (reward_failures, non_finite, diverged, finish), finish_step


def _watch_hooks(job: _Job, record):
    """The hooks of the run's watches: reward failures and finite divergence (their state is
    kept in ``job.meta``, so it is saved with every checkpoint). ``record(step, row, with_row)``
    writes a step's samples and row (`_step_hooks`)."""

    def reward_failures(result: StepResult) -> None:
        step, f = int(result.run.train.step), result.reward_failures
        try:
            lines = job.reward_watch.observe(step, f["failed"], f["scored"], f["errors"])
        except rewards_failures.RewardFailureError:
            record(step, result.row, True)  # the failing step's row (reward/num_crashes ...)
            raise
        for line in lines:
            _say(line)
        job.meta[_REWARD_FAILURES] = job.reward_watch.state()  # saved with the checkpoints

    def diverged(result: StepResult) -> None:
        run, step = result.run, int(result.run.train.step)
        lines, stop = job.divergence.observe(step, result.row)
        for line in lines:
            _say(line)
        job.meta[_DIVERGENCE] = job.divergence.state()
        if stop:
            record(step, result.row, True)
            job.save(run)  # the diverged state, to inspect (the earlier checkpoints are kept)
            raise divergence.DivergenceError(f"{stop} (checkpoint {step} in {job.ckpt.directory})")

    return reward_failures, diverged


def _train(config, workdir, allow_changes, sig, stack, callables, group) -> dict:
    new_workdir = not os.path.exists(os.path.join(workdir, "config.json"))
    processes = group.processes if group is not None else None
    changes = config_utils.check_workdir(config, workdir, allow_changes, processes=processes)
    wall0 = time.perf_counter()
    progress = {}
    try:
        job, run, restored = _start(
            config, workdir, allow_changes, sig, stack, progress, new_workdir, callables, group
        )
    except preemption.Interrupted:
        preemption.quiesce()
        step = progress.get("step")
        where = "resuming" if step is not None else "the set-up, warm start or first evaluation"
        _say(
            f"{sig.name} during {where}: nothing new was saved"
            + (f" (checkpoint {step} is intact)" if step is not None else "")
            + "; rerun the same command to continue; exiting."
        )
        return {"preempted": True, "step": step, "signal": sig.name}
    job.wall0 = wall0
    if changes:
        _say(f"WARNING: continuing with config changes allowed by --allow_changes: {changes}")
        job.meta["config_changes"] = [
            *job.meta.get("config_changes", []),
            {"step": int(run.train.step), "changes": changes},
        ]
    generation = None
    if group is not None:  # the generation group generates the rollouts in flight
        generation = group.connect(job.exp)
        stack.callback(generation.close)  # its stop order, whatever ends the run
        job.complete = generation.complete  # a checkpoint receives the batches ordered
        run = generation.start(run, job.source)  # a new run: the first k orders
    elif not restored:
        # rollouts in flight (rollout.max_staleness): generated now, part of every checkpoint
        run = fill_in_flight(job.exp, job.fns, run, job.source)
    if not restored:
        job.save(run)
    pending = job.meta.pop(_PENDING_EVAL, None)  # a step whose evaluation a signal interrupted
    step = int(run.train.step)
    job.reward_watch = _reward_watch(config, workdir, job.meta.get(_REWARD_FAILURES), step)
    opt = job.exp.run.optimizer
    job.divergence = divergence.DivergenceWatch(
        opt.divergence_warn, opt.divergence_stop, job.meta.get(_DIVERGENCE)
    )
    writer = _open_writer(job, step, pending, stack)
    bar = _progress_bar(job.exp.run, step, stack)
    final_eval: dict = {}
    hooks, finish_step = _step_hooks(job, writer, bar, final_eval)
    stopped = pending is not None and finish_step(run, pending, saved=True)
    if not stopped:
        run, stopped = run_steps(
            job.exp,
            job.fns,
            run,
            job.source,
            until=config.steps,
            hooks=hooks,
            sample_in_flight=generation.sample if generation is not None else None,
        )
    if stopped:
        return {"preempted": True, "step": int(run.train.step), "signal": sig.name}
    try:
        with sig.abortable():  # (already done when the last step ran in this process)
            eval_after = final_eval.get("eval_after") or job.evaluate(run)
    except preemption.Interrupted:
        preemption.quiesce()
        _say(
            f"{sig.name} during the final evaluation: checkpoint {int(run.train.step)} is "
            "complete; rerun the same command to evaluate it and write the summary; exiting."
        )
        return {"preempted": True, "step": int(run.train.step), "signal": sig.name}
    summary = {
        "algorithm": config.algorithm.name,
        "steps": int(run.train.step),
        "wall_seconds": job.wall_seconds(),  # every part of a resumed run
        "eval_before": job.meta["eval_before"],
        "eval_after": eval_after,
        "sft": job.meta.get("sft", {}),
        "data": job.exp.pool.stats,
    }
    if jax.process_index() == 0:
        tmp = os.path.join(workdir, "summary.json.tmp")
        with open(tmp, "w") as f:
            json.dump(writers.to_jsonable(summary), f, indent=2, sort_keys=True)
        os.replace(tmp, os.path.join(workdir, "summary.json"))
        if bar is not None:
            bar.close()  # its last line ends before the table starts (close is idempotent)
        print(evaluation.format_summary(summary), flush=True)
    # the run's last lines: a reward that failed, a run that never had a learning signal, and
    # where the outputs are
    for warning in (job.reward_watch.final_warning(), job.divergence.final_warning()):
        if warning:
            _say(warning)
    if jax.process_index() == 0:
        print(_outputs_line(workdir, int(run.train.step)), flush=True)
    return summary


def _outputs_line(workdir: str, step: int) -> str:
    """Where the run's outputs are: the workdir and its main files (the line a run ends with)."""
    names = ["summary.json", "metrics.jsonl", "samples.jsonl", "config.json"]
    found = [n for n in names if os.path.exists(os.path.join(workdir, n))]
    return (
        f"outputs in {os.path.abspath(workdir)}: {', '.join(found)}, checkpoints/{step} "
        f"(next: python -m experiments.evaluate / export / report --workdir={workdir})"
    )


def _reward_watch(config, workdir: str, state: dict | None, step: int):
    """The run's `rewards_failures.RewardFailures` (its counters from a checkpoint's meta)."""
    kind, value, *_ = reward_from_config.reward_key(config)
    name = f"(the built-in {value!r} verifier)" if kind == "task" else repr(value)
    path = os.path.join(workdir, rewards_failures.ERRORS_FILE)
    return rewards_failures.RewardFailures(
        name,
        max_failed_steps=config.reward.max_failed_steps,
        warn_rate=config.reward.warn_failure_rate,
        path=path if jax.process_index() == 0 else None,
        state=state,
        step=step,
    )


def _check_runnable(config, exp: Experiment) -> None:
    """Checks that need the built experiment (the mesh), before any work is done."""
    div = sharding.batch_divisor(exp.mesh)
    k = config.eval.num_samples
    rows = max(config.eval.batch_size // k, 1) * k
    if rows % div:
        raise ConfigError(
            f"config.eval: each evaluation call samples max(batch_size // num_samples, 1) * "
            f"num_samples = {rows} rows (batch_size={config.eval.batch_size}, "
            f"num_samples={k}), which do not divide over the mesh's data x fsdp = {div} "
            f"shards; make it a multiple of {div}"
        )
