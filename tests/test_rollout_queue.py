"""Rollouts in flight (``rollout.max_staleness``, `grpo_jax.rollout_queue`): the step's schedule
against a reference built from the step's programs, resume with batches in flight, the config."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import _sigterm_after, smoke_config
from test_transfer_guard import _guarded_step
from workdirs import differences as workdir_differences

from grpo_jax import config_utils, steps, train, writers
from grpo_jax import rollout_queue as rq
from grpo_jax import transfer as xfer
from grpo_jax.errors import ConfigError
from grpo_jax.experiment import build_experiment
from grpo_jax.state import Batch, RunState

_TIS = {"algorithm.tis_cap": 2.0}
_STEPS = 3


def _length_reward(texts, golds):
    """A reward that varies within every group from the first step (completion length), so
    the parameters move and a batch of other parameters gives other numbers."""
    del golds
    r = np.asarray([len(t) / 6.0 for t in texts], np.float32)
    return r, r > 0.5, {}


def _step_keys(rng):
    """`train._step_keys`, written out: (next run key, sampling key, mini-batch key)."""
    rng, gen_key = jax.random.split(rng)
    return rng, gen_key, jax.random.fold_in(gen_key, 0x5EED)


def _reference(exp, fns, k: int, steps_: int):
    """GRPO with rollouts k updates old, from the step's programs: the batch trained at step t
    is sampled from the parameters after max(t - k, 0) updates (the first k + 1 batches from
    the initial ones), with its sampler log-probs for TIS. Returns (params, losses, tis)."""
    run, _ = steps.init_run(exp, warm_start=False)
    state, source, mesh = run.train, exp.make_source(), exp.mesh
    n = exp.config.rollout.rollouts_per_prompt

    def generate(params, key):
        ids = np.asarray([p["id"] for p in source.next()], np.int32)
        rows = np.repeat(ids, n)
        tok, mask = (xfer.to_device(mesh, a[rows]) for a in (exp.pool.tokens, exp.pool.mask))
        return rows, mask, fns.generate(params, tok, mask, key)

    def update(state, batch, key):
        rows, prompt_mask, ro = batch
        comp, lengths = xfer.to_host((ro.completion_tokens, ro.lengths))
        texts = xfer.decode_completions(exp.tokenizer, comp, lengths)
        rewards = xfer.to_device(mesh, _length_reward(texts, None)[0])
        seg = xfer.to_device(mesh, np.repeat(np.arange(len(rows) // n, dtype=np.int32), n))
        adv, _ = fns.advantages(rewards, seg)
        R = len(rows)
        b = Batch(
            tokens=ro.tokens,
            attention_mask=jnp.concatenate([prompt_mask, ro.completion_mask > 0], axis=1),
            completion_mask=ro.completion_mask,
            advantages=adv,
            sample_weights=xfer.to_device(mesh, np.ones(R, np.float32)),
            old_logprobs=None,  # one pass, one mini-batch: the update's own (detached)
            ref_logprobs=None,
            sampler_logprobs=ro.logprobs,
        )
        return fns.train(state, b, key)

    queue = [generate(state.params, rq.fill_key(state.rng, i)) for i in range(k)]
    rng, losses, tis = state.rng, [], []
    for _ in range(steps_):
        rng, gen_key, order_key = _step_keys(rng)
        queue.append(generate(state.params, gen_key))
        state, m = update(state, queue.pop(0), order_key)
        losses.append(float(m["loss"]))
        tis.append(float(m.get("tis_weight_mean", 1.0)))
    return jax.device_get(state.params), losses, tis


def _loop(exp, fns, steps_: int):
    run, _ = steps.init_run(exp, warm_start=False)
    rows = []
    run, _ = train.run_steps(
        exp, fns, run, exp.make_source(), until=steps_, hooks=(lambda r: rows.append(r.row),)
    )
    return jax.device_get(run.train.params), rows


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow  # ~1 min: two experiments' steps compiled
def test_the_loop_trains_on_rollouts_of_the_parameters_k_updates_old_with_tis():
    """k = 0: the synchronous step (what the loop always did); k = 1: each step trains on the
    batch the previous parameters sampled, TIS against its sampler log-probs. Bit for bit."""
    got = {}
    for k in (0, 1):
        cfg = smoke_config("grpo", **{"rollout.max_staleness": k, **_TIS})
        exp = dataclasses.replace(build_experiment(cfg), reward_fn=_length_reward)
        try:
            fns = steps.make_steps(exp)
            params, rows = _loop(exp, fns, _STEPS)
            ref_params, ref_losses, ref_tis = _reference(exp, fns, k, _STEPS)
        finally:
            exp.close()
        assert [r["loss"] for r in rows] == ref_losses
        assert [r["tis_weight_mean"] for r in rows] == ref_tis
        assert _same(params, ref_params)
        if k:
            assert [r["policy_version"] for r in rows] == [0, 0, 1]
            assert [r["staleness"] for r in rows] == [0, 1, 1]
            assert ref_tis[1] != 1.0  # stale rollouts: the TIS weights act
        else:
            assert not any("policy_version" in r for r in rows)  # rows as they always were
        got[k] = params
    assert not _same(got[0], got[1])  # the schedule changes the run: the test can tell


@pytest.mark.slow  # ~3-4 min per k: three smoke runs
@pytest.mark.parametrize("k", [1, 2])
def test_resume_with_rollouts_in_flight_equals_the_uninterrupted_run(tmp_path, k):
    cfg = smoke_config(
        "grpo",
        steps=5,
        **{"rollout.max_staleness": k, "checkpoint.every_steps": 1, "sft.steps": 40, **_TIS},
    )
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    train.train_and_evaluate(cfg, str(straight))
    watcher = _sigterm_after(str(interrupted), 2, os.getpid())
    result = train.train_and_evaluate(cfg, str(interrupted))
    watcher.join(timeout=1)
    assert result.get("preempted") and 2 <= result["step"] < 5, result
    train.train_and_evaluate(cfg, str(interrupted))  # resumes with the batches in flight
    problems = workdir_differences(straight, interrupted)
    assert not problems, "\n".join(problems)
    rows = [r for r in writers.read_jsonl(str(straight / "metrics.jsonl")) if "loss" in r]
    assert [r["staleness"] for r in rows] == [min(t, k) for t in range(5)]
    assert any(r["advantage_abs_mean"] > 0 for r in rows)  # the parameters moved


@pytest.mark.slow  # ~30 s: one experiment's steps compiled
def test_a_step_with_rollouts_in_flight_crosses_only_at_the_named_crossings(monkeypatch):
    """The queue's own moves (`rollout_queue.park` / `unpark`) are explicit crossings."""
    cfg = smoke_config("grpo", **{"rollout.max_staleness": 1, **_TIS})
    row, _ = _guarded_step(cfg, monkeypatch)
    assert row["staleness"] == 1 and np.isfinite(row["loss"])


def test_a_run_without_rollouts_in_flight_keeps_its_checkpoint_tree():
    """k = 0 saves the tree it always saved (older checkpoints restore, files unchanged)."""

    def paths(run):
        return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(run)[0]]

    assert paths(RunState(1, {"c": 2}, 3)) == [".train", ".controllers['c']", ".ref_params"]
    with_queue = RunState(1, {"c": 2}, None, (rq.Generated(4, 5, 6, 7),))
    assert paths(with_queue)[-1] == ".in_flight[0].rollouts"
    assert jax.tree.map(lambda x: x, with_queue) == with_queue


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"rollout.max_staleness": 1}, "set config.algorithm.tis_cap"),
        ({"rollout.max_staleness": -1}, r"max_staleness=-1 must be an integer"),
        (
            {"rollout.max_staleness": 1, "algorithm.dynamic_sampling": True, **_TIS},
            "samples extra rounds after scoring",
        ),
        (
            {"rollout.max_staleness": 1, "algorithm.name": "online_filter", **_TIS},
            "'online_filter' with dynamic_sampling=False samples extra rounds",
        ),
    ],
)
def test_max_staleness_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config_utils.validate(smoke_config("grpo", **overrides))
