"""The RL loop, top to bottom: `train_and_evaluate(config, workdir)` and one step, `rl_step`.

`experiments/run.py` is a thin absl wrapper around `train_and_evaluate`; notebooks call it
directly. The algorithm (``config.algorithm.name``) is a registered curriculum + learner
(`grpo_jax.algorithms`); the step below calls their hooks and never branches on the name:

  1. draw P prompts                          curriculum.draw      (host: example dicts)
  2. bins and rollouts per prompt            curriculum.allocate  (R = P * n_bar fixed)
  3. generate R completions                  steps.generate       (device)
  4. score them                              reward_fn            (host, worker processes)
     [DAPO dynamic sampling: more rounds of 1-4 until P groups have unequal rewards]
  5. group advantages + per-rollout weights  steps.advantages, curriculum.weights (device)
  6. reference / old log-probs               steps.logprobs       (device; skipped if unused)
  7. num_iterations x mini-batch updates     steps.train          (device, one program)
  8. the curriculum learns from the step     curriculum.update    (classifier, controllers)
  9. one metrics row; checkpoint on schedule or on a signal

Host <-> device: prompts go up once per sampler call (step 3), completions come down once
(step 4, to be detokenised and verified), and the step's metrics come down in one transfer
(step 9). The curriculum's controllers are small arrays updated eagerly on the host's device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from grpo_jax import advantages as advantages_lib
from grpo_jax import (
    algorithms,
    checkpointing,
    config_utils,
    evaluation,
    gdro,
    losses,
    steps,
    writers,
)
from grpo_jax import transfer as xfer
from grpo_jax.experiment import Experiment, build_experiment
from grpo_jax.state import Batch, RunState


@dataclasses.dataclass(frozen=True)
class Round:
    """One sampling round (steps 1-4 of `rl_step`): P prompts and their R rollouts.

    Host arrays: ids [P] int32, rows [R] (prompt id of each rollout), rewards [R] float32,
    correct [R] bool, lengths [R] int32, informative [P] bool (the group's rewards are not all
    equal). Device arrays: rollouts (`sampling.Rollouts`, [R, ...]), prompt_mask [R, Lp] bool.
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
    reward_stats: dict
    times: dict

    @property
    def visit(self) -> algorithms.Visit:
        return algorithms.Visit(self.ids, self.correct, self.placement.segment_ids)


def _timer():
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


def sample_round(exp: Experiment, fns: steps.Steps, run: RunState, source, key) -> Round:
    """Steps 1-4: draw, classify and allocate, generate, reward."""
    times, t = {}, _timer()
    cur, step = exp.curriculum, int(run.train.step)
    prompts = cur.draw(run.controllers, source, step)
    ids = np.asarray([p["id"] for p in prompts], np.int32)
    placement = cur.allocate(run.controllers, ids)
    rows = ids[placement.segment_ids]
    times["prepare"] = t()

    t = _timer()
    R, gbs = len(rows), exp.generate_batch_size
    keys = [key] if gbs >= R else list(jax.random.split(key, R // gbs))
    parts = [
        fns.generate(
            run.train.params,
            xfer.to_device(exp.mesh, exp.prompt_tokens[rows[s : s + gbs]]),
            xfer.to_device(exp.mesh, exp.prompt_mask[rows[s : s + gbs]]),
            k,
        )
        for k, s in zip(keys, range(0, R, gbs))
    ]
    rollouts = parts[0] if len(parts) == 1 else fns.concat(parts)
    completions, lengths = xfer.to_host((rollouts.completion_tokens, rollouts.lengths))
    times["generate"] = t()

    t = _timer()
    texts = xfer.decode_completions(exp.tokenizer, completions, lengths)
    rewards, correct, reward_stats = exp.reward_fn(texts, [exp.golds[r] for r in rows])
    rewards, correct = np.asarray(rewards, np.float32), np.asarray(correct, bool)
    seg, P = placement.segment_ids, len(ids)
    hi, lo = np.full(P, -np.inf, np.float32), np.full(P, np.inf, np.float32)
    np.maximum.at(hi, seg, rewards)
    np.minimum.at(lo, seg, rewards)
    times["reward"] = t()
    return Round(
        ids=ids,
        placement=placement,
        rows=rows,
        rollouts=rollouts,
        prompt_mask=xfer.to_device(exp.mesh, exp.prompt_mask[rows]),
        rewards=rewards,
        correct=correct,
        lengths=np.asarray(lengths),
        informative=hi > lo,
        reward_stats=dict(reward_stats),
        times=times,
    )


def keep_informative_groups(exp: Experiment, fns: steps.Steps, rounds: list[Round]) -> Round:
    """DAPO dynamic sampling (Yu et al. 2025, Eq. 11): a batch of P groups of the same size,
    groups with unequal rewards first (in the order they were sampled); when the rounds ran out
    before P such groups were found, the rest is filled with all-equal groups (zero advantage,
    so they add only the KL term), keeping every shape fixed. Needs a fixed group size.
    """
    P, n = exp.config.rollout.prompts_per_step, exp.config.rollout.rollouts_per_prompt
    R = P * n
    order = [(r, g) for r, x in enumerate(rounds) for g in np.flatnonzero(x.informative)]
    order += [(r, g) for r, x in enumerate(rounds) for g in np.flatnonzero(~x.informative)]
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
        fns.concat([(x.rollouts, x.prompt_mask) for x in rounds]), jnp.asarray(src)
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
        reward_stats={},
        times={},
    )


def rl_step(exp: Experiment, fns: steps.Steps, run: RunState, source) -> tuple[RunState, dict]:
    """One RL step (see the module docstring). Returns (run state, metrics row)."""
    cfg = exp.config
    P = cfg.rollout.prompts_per_step
    rng, gen_key = jax.random.split(run.train.rng)
    order_key = jax.random.fold_in(gen_key, 0x5EED)  # mini-batch shuffles (steps.train)

    # 1-4. prompts -> bins -> allocation -> R rollouts -> rewards (one round; with DAPO dynamic
    # sampling, more rounds until P groups have unequal rewards, at most 1 + max_rounds rounds).
    rounds = [sample_round(exp, fns, run, source, gen_key)]
    if cfg.algorithm.dynamic_sampling:
        for r in range(cfg.algorithm.dynamic_sampling_max_rounds):
            if sum(int(x.informative.sum()) for x in rounds) >= P:
                break
            rounds.append(sample_round(exp, fns, run, source, jax.random.fold_in(gen_key, r + 1)))
    rd = rounds[0] if len(rounds) == 1 else keep_informative_groups(exp, fns, rounds)
    times = {k: sum(x.times[k] for x in rounds) for k in ("prepare", "generate", "reward")}

    # 5-6. advantages, the curriculum's weights, reference and old log-probs -> the batch.
    t = _timer()
    algo, ro = cfg.algorithm, rd.rollouts
    seg = jnp.asarray(rd.placement.segment_ids)
    rewards = jnp.asarray(rd.rewards)
    if algo.overlong_penalty_factor:  # DAPO soft overlong punishment (Yu et al. 2025, Eq. 13)
        rewards = rewards + advantages_lib.overlong_penalty(
            ro.lengths, exp.max_new_tokens, algo.overlong_cache_tokens, algo.overlong_penalty_factor
        )
    adv, adv_stats = fns.advantages(rewards, seg)
    weights = exp.curriculum.weights(run.controllers, rd.placement, adv)
    attention_mask = jnp.concatenate([rd.prompt_mask, ro.completion_mask > 0], axis=1)
    zeros = jnp.zeros_like(ro.logprobs)
    uses_ref = algo.kl_coef > 0
    loss_mask = ro.completion_mask
    if algo.overlong_filtering:  # DAPO: truncated completions carry no loss
        loss_mask = losses.overlong_filter(loss_mask, ro.truncated)
    batch = Batch(
        tokens=ro.tokens,
        attention_mask=attention_mask,
        completion_mask=loss_mask,
        advantages=adv,
        sample_weights=weights,
        old_logprobs=zeros
        if exp.on_policy
        else fns.logprobs(run.train.params, ro.tokens, attention_mask),
        ref_logprobs=fns.logprobs(run.ref_params, ro.tokens, attention_mask) if uses_ref else zeros,
        sampler_logprobs=ro.logprobs,
    )
    batch = fns.finish_batch(run.train, batch, rewards)
    jax.block_until_ready(batch)
    times["reference"] = t()

    # 7. the updates: num_iterations passes of mini-batches, on device.
    t = _timer()
    state, upd = fns.train(run.train, batch, order_key)
    summary = {
        "advantage_abs_mean": jnp.mean(jnp.abs(adv)),
        "sample_weight_max": jnp.max(weights),
        "truncated_fraction": jnp.mean(ro.truncated.astype(jnp.float32)),
        "consecutive_skips": state.skips,
    }
    upd, adv_stats, summary, adv = xfer.to_host((upd, adv_stats, summary, adv))  # one read
    times["update"] = t()

    # 8. the curriculum learns from the step (every round's visits count, dropped groups too).
    t = _timer()
    outcome = algorithms.StepOutcome(
        placement=rd.placement,
        rewards=rd.rewards,
        correct=rd.correct,
        per_rollout_loss=np.asarray(upd.pop("per_rollout_loss")),
        advantages=adv,
        visits=tuple(x.visit for x in rounds),
    )
    controllers, diagnostics = exp.curriculum.update(run.controllers, outcome)
    state = state.replace(
        step=jax.device_put(state.step + 1, state.step.sharding),
        rng=jax.device_put(rng, state.rng.sharding),
    )
    times["controllers"] = t()

    # 9. the metrics row.
    generated = int(sum(int(x.lengths.sum()) for x in rounds))  # every round's compute
    seg_np = rd.placement.segment_ids
    any_correct = np.zeros(P, bool)
    np.logical_or.at(any_correct, seg_np, rd.correct)
    row = {
        "reward_mean": float(rd.rewards.mean()),
        "pass_rate": float(rd.correct.mean()),
        "any_correct_rate": float(any_correct.mean()),
        "completion_length": float(rd.lengths.mean()),
        "truncated_fraction": float(summary["truncated_fraction"]),
        "advantage_abs_mean": float(summary["advantage_abs_mean"]),
        "sample_weight_max": float(summary["sample_weight_max"]),
        "skipped_updates": int(upd.pop("skipped_updates")),
        "consecutive_skips": int(summary["consecutive_skips"]),
        "generated_tokens": generated,
        **{k: float(v) for k, v in upd.items()},
    }
    reward_stats = {k: sum(x.reward_stats[k] for x in rounds) for k in rounds[0].reward_stats}
    row.update({f"reward/{k}": int(v) for k, v in reward_stats.items()})
    row.update({f"advantages/{k}": int(v) for k, v in adv_stats.items()})
    levels = np.asarray([exp.levels[r] for r in rd.rows])
    for lvl in np.unique(levels):
        row[f"pass_rate/level_{int(lvl)}"] = float(rd.correct[levels == lvl].mean())
    # prompts per bin; the last entry counts never-seen prompts (their own state)
    row["bin_counts"] = np.bincount(rd.placement.bins, minlength=exp.num_bins + 1).tolist()
    if cfg.algorithm.dynamic_sampling:
        row["dynamic_sampling/rounds"] = len(rounds)
        row["dynamic_sampling/informative_groups"] = int(sum(x.informative.sum() for x in rounds))
        row["dynamic_sampling/kept_informative"] = int(rd.informative.sum())  # of P in the batch
    row.update(diagnostics)
    row.update({f"time/{k}": v for k, v in times.items()})
    row["time/step"] = sum(times.values())
    row["tokens_per_s/generate"] = generated / max(times["generate"], 1e-9)
    return RunState(train=state, controllers=controllers, ref_params=run.ref_params), row


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


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Runs (or resumes) the experiment described by ``config`` in ``workdir``.

    Writes ``metrics.jsonl``, TensorBoard events, Orbax checkpoints and ``summary.json`` into
    ``workdir``; returns the summary dict.

    Raises:
      config_utils.ConfigError: invalid or incompatible configuration (one-line message).
      FloatingPointError: ``optimizer.max_consecutive_skips`` non-finite updates in a row (the
        last good state is checkpointed first).
    """
    config_utils.validate(config)
    os.makedirs(workdir, exist_ok=True)
    config_path = os.path.join(workdir, "config.json")
    new_workdir = not os.path.exists(config_path)
    config_utils.check_workdir(config, workdir)
    wall0 = time.perf_counter()
    try:
        exp = build_experiment(config)
    except (ValueError, FileNotFoundError) as e:  # bad paths, data or values: one line
        if new_workdir and jax.process_index() == 0 and os.path.exists(config_path):
            os.remove(config_path)  # nothing ran: the corrected command must not be refused
        if isinstance(e, config_utils.ConfigError):
            raise
        raise config_utils.ConfigError(" ".join(str(e).split())) from None
    ckpt = checkpointing.Checkpointer(
        os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep
    )
    source = exp.make_source()
    fns = steps.make_steps(exp)
    eval_rng = jax.random.PRNGKey(config.seed + 7)

    def save(run: RunState, meta: dict) -> None:
        extra = {"data": source.get_state(), "config": config.to_dict()}
        ckpt.save(int(run.train.step), run, {**meta, **extra})

    # The initial state: shapes first, materialised directly in its sharding; then either a
    # checkpoint's arrays or the warm start + "before" evaluation of a new run.
    state = steps.init_train_state(exp)
    template = RunState(
        train=state,
        controllers=exp.curriculum.init(),
        ref_params=state.params if config.algorithm.kl_coef > 0 else None,
    )
    restored = ckpt.restore_latest(checkpointing.abstract_like(template))
    if restored is not None:
        step, run, meta = restored
        source.set_state(meta["data"])
        print(f"Resuming from checkpoint at step {step} in {ckpt.directory}", flush=True)
    else:
        run, sft_metrics = steps.init_run(exp, train_state=state)
        meta = {"eval_before": evaluation.evaluate(exp, run.train.params, eval_rng)}
        meta["sft"] = sft_metrics
        save(run, meta)
    writer = writers.MetricsWriter(
        workdir,
        tensorboard=config.logging.tensorboard,
        # row N precedes checkpoint N; at step 0 that row may not have been written yet
        resume_step=int(run.train.step) + 1 if int(run.train.step) else 0,
    )
    if int(run.train.step) == 0:
        before = writers.flatten(meta["eval_before"])
        writer.write(
            0,
            {
                **{f"eval/{k}": v for k, v in before.items()},
                **{f"data/{k}": v for k, v in exp.data_stats.items()},
            },
        )

    bar = None
    if config.logging.progress_bar and jax.process_index() == 0:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=config.steps,
            initial=int(run.train.step),
            desc=config.algorithm.name,
            dynamic_ncols=True,
        )
    preempted = False
    with _Preempted() as sigterm:
        while int(run.train.step) < config.steps:
            run, row = rl_step(exp, fns, run, source)
            step = int(run.train.step)
            if int(run.train.skips) >= config.optimizer.max_consecutive_skips:
                writer.write(step, row)  # the failing step's row (loss, grad_norm) is diagnosis
                save(run, meta)
                raise FloatingPointError(
                    f"step {step}: {int(run.train.skips)} consecutive updates had a non-finite "
                    "loss, gradient or update and were skipped; the last good parameters are "
                    f"checkpointed (step {step} in {ckpt.directory}). Likely causes: learning "
                    "rate too high (config.optimizer.learning_rate), bfloat16 overflow "
                    "(config.model.dtype=float32), or non-finite rewards."
                )
            every = config.eval.every_steps
            if every and step % every == 0 and step < config.steps:
                ev = evaluation.evaluate(exp, run.train.params, eval_rng)
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
                save(run, meta)
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
        return {"preempted": True, "step": int(run.train.step)}

    eval_after = evaluation.evaluate(exp, run.train.params, eval_rng)
    summary = {
        "algorithm": config.algorithm.name,
        "steps": int(run.train.step),
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
