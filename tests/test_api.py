"""The Python API (`grpo_jax.api.train`) and batched, weighted reward functions
(`grpo_jax.rewards.batched`, ``config.reward.fns`` + ``reward.weights``), and the metrics rows'
entropy, learning rate and reward spread."""

import json
import math
import os

import numpy as np
import optax
import pytest
from test_byo import _rows, byo_config, write_char_tokenizer

from grpo_jax import api, rewards, state, train
from grpo_jax.errors import ConfigError
from grpo_jax.rewards import batched
from grpo_jax.rewards import from_config as reward_from_config

POOL_MODULE = """
import json
import os
import time

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "batched_calls.jsonl")


def length(completions, prompts, answers, prompt_ids, **columns):
    with open(LOG, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "n": len(completions), "ids": prompt_ids,
                            "keys": sorted(columns), "prompts": prompts}) + "\\n")
    return [float(len(c)) for c in completions]


def hang(completions, **kw):
    time.sleep(60)


def broken(completions, **kw):
    raise KeyError("no such column")
"""


@pytest.fixture
def pool_module(tmp_path, monkeypatch):
    root = tmp_path / "mods"
    root.mkdir()
    (root / "pool_rewards.py").write_text(POOL_MODULE)
    monkeypatch.syspath_prepend(str(root))
    import pool_rewards

    return pool_rewards


@pytest.mark.slow  # ~60 s on 2 busy cores: a tiny model, 3 steps, 3 evaluations
def test_python_api_trains_two_steps_with_weighted_callables_one_batched_call_per_step(
    tmp_path, pool_module
):
    """The must-show: two Python reward callables (one a closure, run in this process; one a
    module function, run in the worker pool) with weights, 2 steps through `api.train`; each
    function's mean is logged and the reward is their weighted sum; the pool function gets the
    whole batch (R completions, the group ids, the columns) in one call per step. The same
    call with one more step resumes (same data file, one more batched call)."""
    files = {"tokenizer": write_char_tokenizer(tmp_path / "tok"), "train": "", "test": ""}
    cfg = byo_config(files, **{"reward.fn": "", "rollout.rollouts_per_prompt": 3})
    closure_calls = []

    def make_match(bonus):
        def match(completions, answers, **columns):
            closure_calls.append(len(completions))
            return [bonus if str(a) in c else 0.0 for c, a in zip(completions, answers)]

        return match

    match = make_match(0.5)
    assert batched.runs_in_pool(pool_module.length) and not batched.runs_in_pool(match)
    workdir = str(tmp_path / "run")
    summary = api.train(
        cfg,
        dataset=_rows(24, 0),
        eval_dataset=_rows(6, 1),
        reward_fns=[pool_module.length, match],
        reward_weights=[0.1, 1.0],
        workdir=workdir,
    )
    assert summary["steps"] == 2 and cfg.reward.fns == () and cfg.data.path == ""  # a copy edited
    rows = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 2
    for r in steps:  # one round per step: reward_mean = 0.1 * mean(length) + 1.0 * mean(match)
        want = 0.1 * r["reward/length_mean"] + 1.0 * r["reward/match_mean"]
        assert r["reward_mean"] == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert r["reward/length_mean"] >= 1.0 and r["reward/num_crashes"] == 0
        assert r["learning_rate"] == pytest.approx(1e-3)
        assert r["entropy"] > 0 and r["reward_std"] >= r["reward_group_std"] >= 0
    saved = json.load(open(os.path.join(workdir, "config.json")))["reward"]
    assert saved["fns"] == ["callable:length", "callable:match"] and saved["weights"] == [0.1, 1.0]
    R = 2 * 3
    calls = [json.loads(x) for x in open(pool_module.LOG)]
    train_calls = [c for c in calls if c["n"] == R]
    assert len(train_calls) == 2  # one call per step with the whole batch (eval calls hold 8)
    assert closure_calls.count(R) == 2
    for c in train_calls:
        assert c["pid"] != os.getpid()  # in the worker pool
        ids = c["ids"]
        assert len(set(ids)) == 2 and all(ids[i] == ids[i - i % 3] for i in range(R))  # groups
        assert {"hint", "level", "question_text"} <= set(c["keys"])
        assert all(p.startswith("What is") for p in c["prompts"])
    cfg.steps = 3  # the same call again, one step further: resumes from checkpoint 2
    again = api.train(
        cfg,
        dataset=_rows(24, 0),
        eval_dataset=_rows(6, 1),
        reward_fns=[pool_module.length, make_match(0.5)],
        reward_weights=[0.1, 1.0],
        workdir=workdir,
    )
    assert again["steps"] == 3 and again["eval_before"] == summary["eval_before"]
    assert len(os.listdir(os.path.join(workdir, "data"))) == 2  # train and eval rows, once each
    calls = [json.loads(x) for x in open(pool_module.LOG)]
    assert [c["n"] for c in calls].count(R) == 3  # one more step, one more call


def test_train_takes_a_typed_run_config_as_the_cli_dict(tmp_path, monkeypatch):
    import dataclasses

    from grpo_jax import config_schema, config_utils

    seen = []
    monkeypatch.setattr(train, "train_and_evaluate", lambda config, *a, **k: seen.append(config))
    rollout = dataclasses.replace(config_schema.RolloutSection(), temperature=0.8)
    api.train(config_schema.RunConfig(steps=7, rollout=rollout), workdir=str(tmp_path))
    want = api.default_config({"steps": 7, "rollout.temperature": 0.8})
    # the same run as the CLI dict: equal once typed, and a resume of one by the other is no
    # change (the mode switches are written resolved by the option dataclasses)
    assert config_schema.typed(seen[0]) == config_schema.typed(want)
    assert config_utils.config_changes(want.to_dict(), seen[0].to_dict()) == []
    prompt_gdro = dataclasses.replace(config_schema.AlgorithmSection(), name="prompt_gdro")
    api.train(config_schema.RunConfig(algorithm=prompt_gdro), workdir=str(tmp_path))
    assert config_schema.typed(seen[1]).gdro.classifier.delta == 0.03  # the curriculum's margin


def test_weighted_sum_none_and_nan_rows_and_correctness_in_process():
    """Hand-computed: weights (2, 1); a None and a NaN row fail (low reward, wrong, counted
    once each); correctness from the function that returns it; each function's mean."""

    def first(completions, **kw):
        return [1.0, None, 3.0, math.nan]

    def second(completions, **kw):
        return [0.5] * 4, [True, True, False, True]

    with batched.BatchedRewards([first, second], [2.0, 1.0]) as fn:
        got, correct, stats = fn(["a", "b", "c", "d"], ["1", "2", "3", "4"])
    np.testing.assert_allclose(got, [2.5, -1.0, 6.5, -1.0])
    np.testing.assert_array_equal(correct, [True, False, False, False])
    assert stats["num_crashes"] == 2 and stats["num_timeouts"] == 0
    assert set(stats["errors"]) == {"None/NaN"}
    assert stats["functions"] == {"first": (4.0, 2), "second": (2.0, 4)}
    fields = rewards.metrics_fields([{k: v for k, v in stats.items() if k != "errors"}] * 2)
    assert fields["reward/first_mean"] == 2.0 and fields["reward/second_mean"] == 0.5
    assert fields["reward/num_crashes"] == 4


def test_batched_call_in_the_pool_is_killed_at_its_limit_and_a_raise_is_a_crash(pool_module):
    with batched.BatchedRewards(
        ["pool_rewards:hang", "pool_rewards:broken"], batch_timeout_s=2.0, num_workers=2
    ) as fn:
        got, correct, stats = fn(["1", "2", "3"], ["1", "2", "3"])
    np.testing.assert_allclose(got, [-1.0] * 3)
    assert not correct.any() and stats["num_timeouts"] == 3 and stats["num_crashes"] == 0
    assert set(stats["errors"]) == {"timeout", "KeyError"}
    assert "broken: KeyError" in stats["errors"]["KeyError"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"reward.fns": ("pool_rewards:length",), "reward.weights": (1.0, 2.0)}, "2 values for 1"),
        ({"reward.fns": ("pool_rewards:length",), "reward.fn": "pool_rewards:length"}, "both"),
        ({"reward.fns": ("callable:mine",)}, "'callable:mine' names a Python callable"),
        ({"reward.fns": ("pool_rewards:lenght",)}, "AttributeError"),
        ({"reward.fns": ("pool_rewards:length", "other_mod:length")}, "unique"),
    ],
)
def test_bad_reward_fns_are_one_line_config_errors(pool_module, overrides, message):
    cfg = api.default_config(overrides)
    with pytest.raises(ConfigError, match=message) as e:
        reward_from_config.check_functions(cfg)
    assert "\n" not in str(e.value)


def test_default_config_names_an_unknown_key():
    assert api.default_config({"steps": 7, "reward.weights": [1, 2]}).reward.weights == (1, 2)
    with pytest.raises(ConfigError, match="rollout.temperature"):
        api.default_config({"rollout.temprature": 0.5})


def test_reward_spread_by_hand():
    r = np.asarray([1.0, -1.0, 1.0, 1.0, 0.0], np.float32)
    seg = np.asarray([0, 0, 1, 1, 1])
    got = train._reward_spread(r, seg, 2)
    assert got["reward_std"] == pytest.approx(np.sqrt(np.mean((r - 0.4) ** 2)))
    assert got["reward_group_std"] == pytest.approx((1.0 + np.sqrt(2 / 9)) / 2)


def test_last_learning_rate_follows_the_warmup_schedule():
    """After k applied updates the logged rate is schedule(k - 1): linear warm-up 0 -> 1e-2
    over 4 updates gives 0, 2.5e-3, 5e-3 after 1, 2, 3 updates."""
    cfg = api.default_config({"optimizer.learning_rate": 1e-2, "optimizer.warmup_steps": 4})
    tx = state.make_optimizer(cfg.optimizer, 10)
    params = {"w": np.ones(2, np.float32)}
    opt = tx.init(params)
    got = []
    for _ in range(3):
        _, opt = tx.update({"w": np.ones(2, np.float32)}, opt, params)
        got.append(float(state.last_learning_rate(state.make_schedule(cfg.optimizer, 10), opt)))
    np.testing.assert_allclose(got, [0.0, 2.5e-3, 5e-3], atol=1e-9)
    assert state.last_learning_rate(lambda c: c, optax.identity().init(params)) is None
