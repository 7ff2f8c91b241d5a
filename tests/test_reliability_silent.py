"""Nothing silent (issue 48, part A): a run that looks fine and is not, or a message that sends the
user the wrong way. A failing reward is printed, kept and stops the run; a range that depends on
the data, an empty file, a wrong column and a reward module that does not import fail before
the weights load, naming the field or file; a diverging or signal-free run says so; a custom
table's files get their sha256. docs/reliability.md tabulates these tests.
"""

import hashlib
import json
import math
import os
import subprocess
import sys

import pytest
from test_byo import REWARD_MODULE, _rows, _write_jsonl, byo_config, write_char_tokenizer
from test_train import REPO, smoke_config

from grpo_jax import divergence, train
from grpo_jax.data import from_config as data_from_config
from grpo_jax.errors import ConfigError
from grpo_jax.models import from_config as model_from_config
from grpo_jax.rewards import failures
from grpo_jax.rewards import from_config as reward_from_config

FAULTY_REWARDS = """
import time


def raises(completions, answers, **fields):
    raise ZeroDivisionError("division by zero in my reward")


def by_text(completions, answers, **fields):
    c = completions[0]
    if c == "raise":
        return [1 / 0]
    if c == "nan":
        return [float("nan")]
    if c == "str":
        return ["abc"]
    if c == "two":
        return [1.0, 2.0]
    if c == "hang":
        time.sleep(3600)
    return [1.0]
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("silent")
    (root / "faulty_rewards.py").write_text(FAULTY_REWARDS)
    (root / "my_rewards.py").write_text(REWARD_MODULE)  # byo_config's own reward
    return {
        "root": root,
        "train": _write_jsonl(root / "train.jsonl", _rows(24, 0)),
        "test": _write_jsonl(root / "test.jsonl", _rows(6, 1)),
        "tokenizer": write_char_tokenizer(root / "tok"),
    }


@pytest.fixture
def on_path(files, monkeypatch):
    monkeypatch.syspath_prepend(str(files["root"]))
    return files


@pytest.fixture
def no_weights(monkeypatch):
    """The model never loads: a check that must come first raises before this is reached."""

    def weights_loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(model_from_config, "load_model", weights_loaded)


def _warnings(text):
    return [line for line in text.splitlines() if line.startswith("WARNING: ")]


# ============================================================================ a failing reward


def test_each_kind_of_reward_failure_keeps_its_first_text(on_path):
    cfg = byo_config(on_path, **{"reward.fn": "faulty_rewards:by_text", "reward.timeout_s": 0.5})
    fn = reward_from_config.make_reward_fn(cfg)
    try:
        texts = ["raise", "nan", "str", "two", "hang", "fine"]
        rewards, _, stats = fn(texts, ["1"] * len(texts))
    finally:
        fn.close()
    assert rewards.tolist() == [-1.0] * 5 + [1.0]
    assert stats["num_crashes"] == 4 and stats["num_timeouts"] == 1
    assert stats["errors"] == {  # the first of each kind, in completion order
        "ZeroDivisionError": "ZeroDivisionError: division by zero",
        "ValueError": "ValueError: reward function returned a non-finite reward: [nan]",
        "timeout": "no result within reward.timeout_s=0.5 s (worker killed)",
    }


def test_reward_failures_print_once_keep_a_resumable_file_stop_and_warn(tmp_path):
    path = str(tmp_path / failures.ERRORS_FILE)
    watch = failures.RewardFailures("'m:f'", max_failed_steps=2, warn_rate=0.1, path=path)
    assert watch.observe(1, 0, 8, {}) == []
    (line,) = watch.observe(2, 8, 8, {"KeyError": "KeyError: 'x'"})
    assert line.startswith("WARNING: step 2: the reward function 'm:f' failed (KeyError)")
    state2 = watch.state()
    assert watch.observe(3, 3, 8, {"KeyError": "KeyError: 'y'"}) == []  # seen: not again
    assert watch.consecutive == 0  # not every rollout failed
    (line,) = watch.observe(4, 8, 8, {"timeout": "t"})
    with pytest.raises(failures.RewardFailureError, match=r"step 5: the reward function 'm:f'"):
        watch.observe(5, 8, 8, {"timeout": "t"})
    rows = [json.loads(x) for x in open(path)]
    assert [(r["step"], r["kind"], r["message"]) for r in rows] == [
        (2, "KeyError", "KeyError: 'x'"),
        (4, "timeout", "t"),
    ]
    assert watch.final_warning().startswith(
        "WARNING: the reward function 'm:f' failed on 27 of 40 rollouts (67.5% > "
        "config.reward.warn_failure_rate=0.1)"
    )
    # a resume from checkpoint 2: its counters, and the file as the uninterrupted run had it
    again = failures.RewardFailures(
        "'m:f'", max_failed_steps=2, warn_rate=0.1, path=path, state=state2, step=2
    )
    assert [json.loads(x)["step"] for x in open(path)] == [2]
    assert again.observe(3, 3, 8, {"KeyError": "KeyError: 'y'"}) == []
    assert (again.failed, again.scored) == (11, 24)
    assert (
        failures.RewardFailures(
            "f", max_failed_steps=0, warn_rate=0.5, state=again.state()
        ).final_warning()
        is None
    )


@pytest.mark.slow
def test_a_reward_that_always_fails_is_reported_and_stops_the_resumed_run(
    on_path, tmp_path, capsys
):
    workdir = str(tmp_path / "run")
    cfg = byo_config(
        on_path, **{"reward.fn": "faulty_rewards:raises", "reward.max_failed_steps": 0}
    )
    summary = train.train_and_evaluate(cfg, workdir)  # 2 steps, every reward raised
    assert summary["steps"] == 2
    out = capsys.readouterr().out
    first = [w for w in _warnings(out) if "failed (ZeroDivisionError)" in w]
    assert len(first) == 1 and "division by zero in my reward" in first[0]  # once per run
    # the run's last lines say what went wrong, before the line naming its outputs
    *last, outputs = out.rstrip().splitlines()[-3:]
    assert outputs.startswith("outputs in ")
    assert last[0].startswith(
        "WARNING: the reward function 'faulty_rewards:raises' failed on 8 of 8 rollouts"
    )
    assert last[1].startswith("WARNING: none of the run's 2 RL steps had a learning signal")
    (row,) = [json.loads(x) for x in open(os.path.join(workdir, failures.ERRORS_FILE))]
    assert row == {
        "step": 1,
        "fn": "'faulty_rewards:raises'",
        "kind": "ZeroDivisionError",
        "message": "ZeroDivisionError: division by zero in my reward",
    }
    # one more step, allowed to fail 3 in a row: the count goes on from the checkpoint
    cfg.steps, cfg.reward.max_failed_steps = 3, 3
    with pytest.raises(failures.RewardFailureError) as e:
        train.train_and_evaluate(cfg, workdir)
    assert str(e.value).startswith(
        "step 3: the reward function 'faulty_rewards:raises' failed on every rollout for 3 "
        "consecutive steps (config.reward.max_failed_steps=3); last error: ZeroDivisionError: "
        "division by zero in my reward"
    )
    assert not [w for w in _warnings(capsys.readouterr().out) if "failed (" in w]  # seen before
    assert len(open(os.path.join(workdir, failures.ERRORS_FILE)).readlines()) == 1


# ============================================================================ checked before anything


def test_prompts_per_step_above_the_pool_is_refused_before_the_weights_and_the_workdir(
    on_path, no_weights, tmp_path
):
    cfg = byo_config(on_path, **{"rollout.prompts_per_step": 25})  # a 24-row table
    with pytest.raises(ConfigError) as e:
        train.train_and_evaluate(cfg, str(tmp_path / "run"))
    assert str(e.value).startswith(
        f"config.rollout.prompts_per_step=25 is more than the 24 training prompts of "
        f"{on_path['train']} (split 'train'); a step draws P distinct prompts: set it to at most 24"
    )
    assert not (tmp_path / "run").exists()  # nothing written


def test_prompts_per_step_far_above_the_dataset_is_one_line_and_writes_nothing(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.run",
            "--config=configs/arithmetic.py:grpo,smoke",
            "--config.mesh.num_devices=1",
            "--config.rollout.prompts_per_step=100000",
            f"--workdir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [x for x in out.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "config.rollout.prompts_per_step=100000 is more than the" in lines[0]
    assert not (tmp_path / "run").exists()


def test_an_empty_data_file_is_named_as_empty(on_path, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = byo_config(on_path, **{"data.path": str(empty)})
    with pytest.raises(ValueError, match=rf"table {empty}: the file is empty"):
        data_from_config.load_examples(cfg, "custom", "train")
    preset = tmp_path / "data" / "gsm8k"
    preset.mkdir(parents=True)
    (preset / "train.jsonl").write_text("\n")
    cfg = smoke_config("grpo", **{"data.name": "gsm8k", "data.source_dir": str(preset.parent)})
    with pytest.raises(ValueError, match=rf"{preset}/train.jsonl: the file is empty"):
        data_from_config.load_examples(cfg, "gsm8k", "train")


@pytest.mark.parametrize("bad_rows", ["error", "skip"])
def test_a_wrong_column_name_lists_the_columns_of_the_file(on_path, bad_rows):
    cfg = byo_config(on_path, **{"data.prompt_column": "question", "data.bad_rows": bad_rows})
    with pytest.raises(ValueError) as e:
        data_from_config.load_examples(cfg, "custom", "train")
    assert str(e.value) == (
        "config.data.prompt_column='question': dataset 'custom': no row of "
        f"{on_path['train']} has a column 'question'; its columns: 'question_text', "
        "'solution_value', 'difficulty', 'uid', 'hint' (set config.data.prompt_column to one "
        "of them)"
    )  # not "bad_rows=skip", which would drop every row


def test_a_reward_module_that_does_not_import_fails_before_the_data_and_weights(
    on_path, no_weights, tmp_path, monkeypatch
):
    def data_loaded(*args, **kwargs):
        raise AssertionError("the data was loaded before the check")

    monkeypatch.setattr(data_from_config, "load_examples", data_loaded)
    cfg = byo_config(on_path, **{"reward.fn": "faulty_rewardz:raises"})
    with pytest.raises(ConfigError, match=r"config.reward.fn: reward function 'faulty_rewardz:"):
        train.train_and_evaluate(cfg, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


# ============================================================================ divergence


def test_divergence_watch_warns_once_stops_past_its_bound_and_sees_no_signal():
    watch = divergence.DivergenceWatch(warn=10.0, stop=1e4)
    assert watch.observe(1, {"loss": 0.1, "grad_norm": 2.0, "advantage_abs_mean": 0.0}) == (
        [],
        None,
    )
    (line,), stop = watch.observe(2, {"loss": -50.0, "grad_norm": 20.0})
    assert stop is None and line.startswith(
        "WARNING: step 2: |loss| = 50 > config.optimizer.divergence_warn=10"
    )
    assert watch.observe(3, {"loss": 0.0, "grad_norm": 500.0}) == ([], None)  # warned once
    assert watch.observe(4, {"loss": math.nan, "grad_norm": math.inf}) == ([], None)  # guard's
    lines, stop = watch.observe(5, {"loss": 1.0, "grad_norm": 2e4})
    assert lines == [] and stop.startswith(
        "step 5: grad_norm = 2e+04 > config.optimizer.divergence_stop=10000"
    )
    assert watch.final_warning().startswith("WARNING: none of the run's 5 RL steps")
    watch.observe(6, {"advantage_abs_mean": 0.5})
    assert watch.final_warning() is None
    off = divergence.DivergenceWatch(warn=0, stop=0, state=watch.state())
    assert off.observe(7, {"grad_norm": 1e30}) == ([], None) and off.steps == 7


@pytest.mark.slow
def test_a_finite_extreme_learning_rate_reaches_the_nonfinite_stop(tmp_path):
    cfg = smoke_config(
        "grpo",
        **{
            "optimizer.learning_rate": 1e12,  # finite: the update overflows the next forward
            "optimizer.max_consecutive_skips": 2,
            "reward.format_reward": 0.5,  # rewards that differ within a group: a gradient
            "steps": 5,
        },
    )
    with pytest.raises(FloatingPointError, match=r"2 consecutive updates had a non-finite"):
        train.train_and_evaluate(cfg, str(tmp_path / "run"))


@pytest.mark.slow
def test_finite_divergence_warns_once_and_stops_with_an_inspectable_checkpoint(tmp_path, capsys):
    cfg = smoke_config(
        "grpo",
        **{
            "optimizer.divergence_warn": 1e-4,  # bounds below the smoke run's grad norm
            "optimizer.divergence_stop": 1e-3,
            "reward.format_reward": 0.5,
        },
    )
    workdir = tmp_path / "run"
    with pytest.raises(divergence.DivergenceError, match=r"^step 1: ") as e:
        train.train_and_evaluate(cfg, str(workdir))
    assert "> config.optimizer.divergence_stop=0.001" in str(e.value)
    assert f"(checkpoint 1 in {workdir / 'checkpoints'})" in str(e.value)
    (warning,) = [w for w in _warnings(capsys.readouterr().out) if "divergence_warn" in w]
    assert warning.startswith("WARNING: step 1: ")
    assert (workdir / "checkpoints" / "1").is_dir()


# ============================================================================ provenance


def test_a_custom_table_gets_its_files_sha256_in_eval_json(on_path):
    from experiments import evaluate

    cfg = byo_config(on_path)
    files = evaluate._data_files([("custom", "test")], "", cfg)
    digest = hashlib.sha256(open(on_path["test"], "rb").read()).hexdigest()
    assert files == {"custom": [{"file": on_path["test"], "sha256": digest, "pinned_sha256": ""}]}
