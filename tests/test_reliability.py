"""Reliability under faults: process death, damaged checkpoints, non-finite updates, verifiers
that hang or crash, and bad input.

The bar: nothing that was checkpointed is lost, a resumed run reproduces the uninterrupted run
bit for bit (metrics, evaluation, final parameters, optimizer, RNG and controller states), and
bad input is one ``error: ...`` line on stderr with a non-zero exit and no traceback.

The end-to-end fault tests drive ``python -m experiments.run`` in subprocesses that share the
session's persistent compilation cache (only the first run of a configuration compiles).
"""

import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from processes import wait_for_training_row
from test_train import REPO, deterministic_rows, smoke_config
from workdirs import differences as workdir_differences
from workdirs import tensorboard_events

from grpo_jax import checkpointing, config_utils, experiment, rewards, steps, train, writers
from grpo_jax.data import arithmetic
from grpo_jax.errors import ConfigError
from grpo_jax.models import from_config as model_from_config
from grpo_jax.models import tokenizer as tokenizer_lib
from grpo_jax.state import Batch

_LOG_LINE = re.compile(r"^[IWEF]\d{4} ")  # absl / glog lines (orbax, jax) on stderr
_CLI_SMOKE = ["--config.mesh.num_devices=1", "--config.logging.tensorboard=False"]
_BUDGET = 8  # prompt budget (tokens) under which some smoke prompts are overlong (4..9 characters)


# ============================================================================ checkpoints


def _tree(i):
    return {
        "w": jax.random.normal(jax.random.PRNGKey(i), (256, 256)) + i,
        "step": jnp.int32(i),
        "mask": jnp.arange(8) % 2 == 0,
    }


def _largest_data_file(step_dir):
    files = glob.glob(os.path.join(step_dir, "state", "ocdbt.process_0", "d", "*"))
    return max(files, key=os.path.getsize)


def _corrupt(step_dir, how):
    """Damages a finalised checkpoint directory the way a failing disk or a bad copy would."""
    if how == "truncate":
        path = _largest_data_file(step_dir)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif how == "flip_bits":  # Orbax reads this back without an error: only the checksum sees it
        path = _largest_data_file(step_dir)
        middle = os.path.getsize(path) // 2
        with open(path, "r+b") as f:
            f.seek(middle)
            data = f.read(8)
            f.seek(middle)
            f.write(bytes(b ^ 0x01 for b in data))
    elif how == "delete_state":
        shutil.rmtree(os.path.join(step_dir, "state"))
    elif how == "empty_files":
        for path in glob.glob(os.path.join(step_dir, "**", "*"), recursive=True):
            if os.path.isfile(path):
                open(path, "w").close()
    else:
        raise ValueError(how)


def _warnings(text):
    return [line for line in text.splitlines() if line.startswith("WARNING: ")]


@pytest.mark.parametrize("how", ["truncate", "flip_bits", "delete_state", "empty_files"])
def test_damaged_latest_checkpoint_warns_and_falls_back_to_the_previous_one(tmp_path, capsys, how):
    d = str(tmp_path / "checkpoints")
    ck = checkpointing.Checkpointer(d, keep=3)
    for s in (1, 2):
        ck.save(s, _tree(s), {"data": {"position": s}})
    ck.close()
    _corrupt(os.path.join(d, "2"), how)

    ck = checkpointing.Checkpointer(d, keep=3)
    step, tree, meta = ck.restore_latest(checkpointing.abstract_like(_tree(0)))
    assert step == 1 and meta == {"data": {"position": 1}}
    np.testing.assert_array_equal(tree["w"], _tree(1)["w"])
    warnings = _warnings(capsys.readouterr().out)
    assert "checkpoint 2 in" in warnings[0] and "is unreadable" in warnings[0]
    assert warnings[0].endswith("falling back to checkpoint 1")
    assert "resuming from checkpoint 1" in warnings[1]
    if how == "flip_bits":
        assert "checksum mismatch (corrupted data) in 1 array(s), first ['w']" in warnings[0]

    # The run goes on: step 2 is written again; the unreadable one is kept aside, not overwritten.
    ck.save(2, _tree(22), {"data": {"position": 22}})
    ck.close()
    assert sorted(os.listdir(d)) == ["1", "2", "2" + checkpointing.UNREADABLE_SUFFIX]
    step, tree, meta = checkpointing.Checkpointer(d).restore_latest(
        checkpointing.abstract_like(_tree(0))
    )
    assert step == 2 and meta["data"]["position"] == 22
    np.testing.assert_array_equal(tree["w"], _tree(22)["w"])


def test_a_read_failing_after_a_signal_is_raised_and_a_fallback_sets_the_newer_one_aside(
    tmp_path, capsys
):
    """A signal inside a restore comes back as Orbax's / TensorStore's error: with the signal
    flag up that error is raised (nothing skipped, moved or warned), not taken for damage. A
    real fallback moves the newer checkpoint aside at once (`set_aside_unreadable`, called by
    a resuming run before it cuts its files back), so no later start resumes from it."""
    d = str(tmp_path / "checkpoints")
    ck = checkpointing.Checkpointer(d, keep=3)
    for s in (1, 2):
        ck.save(s, _tree(s), {"data": {"position": s}})
    ck.close()
    _corrupt(os.path.join(d, "2"), "truncate")
    template = checkpointing.abstract_like(_tree(0))

    ck = checkpointing.Checkpointer(d, keep=3)
    with pytest.raises(Exception):  # whatever the library raised
        ck.restore_latest(template, interrupted=lambda: True)
    assert _warnings(capsys.readouterr().out) == [] and sorted(os.listdir(d)) == ["1", "2"]
    step, _, _ = ck.restore_latest(template, interrupted=lambda: False)
    assert step == 1
    ck.set_aside_unreadable()
    assert sorted(os.listdir(d)) == ["1", "2" + checkpointing.UNREADABLE_SUFFIX]
    ck.close()


def test_interrupted_save_is_reported_discarded_and_the_step_saved_again(tmp_path, capsys):
    d = str(tmp_path / "checkpoints")
    ck = checkpointing.Checkpointer(d)
    for s in (1, 2):
        ck.save(s, _tree(s), {"data": {"position": s}})
    ck.close()
    # What a SIGKILL in the middle of saving step 3 leaves: Orbax's half-written temporary dir.
    partial = os.path.join(d, "3" + checkpointing.TMP_MARK)
    shutil.copytree(os.path.join(d, "2"), partial)
    os.remove(_largest_data_file(partial))

    ck = checkpointing.Checkpointer(d)
    step, _, _ = ck.restore_latest(checkpointing.abstract_like(_tree(0)))
    assert step == 2
    (warning,) = _warnings(capsys.readouterr().out)
    assert "1 incomplete checkpoint(s)" in warning and "3" + checkpointing.TMP_MARK in warning
    ck.save(3, _tree(3), {"data": {"position": 3}})
    ck.close()
    assert sorted(os.listdir(d)) == ["1", "2", "3"]


def test_no_readable_checkpoint_is_an_error_never_a_silent_fresh_start(tmp_path):
    d = str(tmp_path / "checkpoints")
    ck = checkpointing.Checkpointer(d)
    for s in (1, 2):
        ck.save(s, _tree(s), {})
    ck.close()
    for s in (1, 2):
        _corrupt(os.path.join(d, str(s)), "delete_state")
    with pytest.raises(checkpointing.CheckpointError, match="no readable checkpoint") as e:
        checkpointing.Checkpointer(d).restore_latest(checkpointing.abstract_like(_tree(0)))
    assert "\n" not in str(e.value) and "--config.checkpoint.overwrite=True" in str(e.value)
    assert sorted(os.listdir(d)) == ["1", "2"]  # restoring never moves or deletes anything


def test_fingerprint_is_independent_of_sharding_and_sees_every_word():
    rng = np.random.default_rng(0)
    host = {
        "x": rng.standard_normal((8, 6)).astype(np.float32),
        "i": np.arange(5, dtype=np.int32),
        "b": np.array([True, False]),
        "h": np.ones((3,), jnp.bfloat16),
        "s": np.float32(3.0),
    }
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    sharded = {
        **jax.tree.map(jnp.asarray, host),
        "x": jax.device_put(host["x"], NamedSharding(mesh, PartitionSpec("a", "b"))),
    }
    fp = checkpointing.fingerprint(host)
    assert checkpointing.fingerprint(sharded) == fp
    assert checkpointing.fingerprint(jax.tree.map(jnp.asarray, host)) == fp
    # by hand: words 0..4; sum = 10; sum of w * (2 * index + 1) = 0 + 3 + 10 + 21 + 36 = 70
    assert fp["['i']"] == f"{10:08x}{70:08x}"
    for i, j in [(0, 0), (3, 4), (7, 5)]:  # one flipped bit anywhere changes the checksum
        bad = host["x"].copy()
        bad.view(np.uint32)[i, j] ^= 1
        assert checkpointing.fingerprint({**host, "x": bad})["['x']"] != fp["['x']"]
    swapped = host["x"].copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # same words, other places: the weighted sum sees it
    assert checkpointing.fingerprint({**host, "x": swapped})["['x']"] != fp["['x']"]


def test_metrics_line_torn_by_a_kill_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = "".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in range(3))
    path.write_text(rows + '{"step": 3, "loss": 0.')  # killed in the middle of writing row 3
    writer = writers.MetricsWriter(str(tmp_path), tensorboard=False, resume_step=3)
    writer.write(3, {"loss": 1.0})
    writer.close()
    assert [r["step"] for r in writers.read_jsonl(str(path))] == [0, 1, 2, 3]


def test_resume_rewrites_metrics_samples_and_tensorboard_from_one_step(tmp_path):
    """A run killed after writing steps 2 and 3 but checkpointed at 1: the resumed writer drops
    both files' rows from step 2 on and TensorBoard hides its events from step 2 on, so what
    is left equals a straight run's (the killed tail had other values: they must not show)."""

    def write(writer, steps, loss):
        for step in steps:
            writer.write_samples(step, [{"prompt": f"p{step}", "reward": loss(step)}] * (step > 0))
            writer.write(step, {"loss": loss(step)})
        writer.close()

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    write(writers.MetricsWriter(str(straight), resume_step=0), range(4), lambda s: s / 2)
    write(
        writers.MetricsWriter(str(resumed), resume_step=0), range(4), lambda s: s / 2 + (s > 1) * 99
    )
    write(writers.MetricsWriter(str(resumed), resume_step=2), [2, 3], lambda s: s / 2)
    write(writers.MetricsWriter(str(resumed), resume_step=4), [], None)  # a resume at the end

    for name in ("metrics.jsonl", "samples.jsonl"):
        assert (resumed / name).read_text() == (straight / name).read_text()
    events = tensorboard_events(str(resumed / "tensorboard"))
    assert events == tensorboard_events(str(straight / "tensorboard"))
    assert [(step, tag) for step, tag, _ in events if tag == "loss"] == [
        (s, "loss") for s in range(4)
    ]
    assert [step for step, tag, _ in events if tag == "samples/text_summary"] == [1, 2, 3]


# ============================================================================ numerics and rewards


@pytest.fixture(scope="module")
def built():
    """The smoke experiment and its jitted step functions (compiled once for this module)."""
    exp = experiment.build_experiment(smoke_config("grpo"))
    fns = steps.make_steps(exp)
    yield exp, fns
    exp.close()


def _batch(exp, advantages, completion_mask, seed=0):
    R, lc = advantages.shape[0], exp.max_new_tokens
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, exp.tokenizer.vocab_size, (R, exp.prompt_len + lc)).astype(np.int32)
    zeros = jnp.zeros((R, lc), jnp.float32)
    return Batch(
        tokens=jnp.asarray(tokens),
        attention_mask=jnp.ones(tokens.shape, bool),
        completion_mask=jnp.asarray(completion_mask, jnp.float32),
        advantages=jnp.asarray(advantages, jnp.float32),
        sample_weights=jnp.ones((R,), jnp.float32),
        old_logprobs=zeros,
        ref_logprobs=zeros,
        sampler_logprobs=zeros,
    )


def _tree_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow
def test_nonfinite_update_is_skipped_counted_and_the_count_resets(built):
    exp, fns = built
    R = exp.config.rollout.prompts_per_step * exp.config.rollout.rollouts_per_prompt
    state = steps.init_train_state(exp)
    start = jax.device_get(state.params)
    adv = np.random.default_rng(1).standard_normal(R).astype(np.float32)
    mask = np.ones((R, exp.max_new_tokens), np.float32)

    nan_in = adv.copy()
    nan_in[1] = np.nan  # a NaN advantage on masked-in tokens
    for skips in (1, 2):
        state, m = fns.update(state, _batch(exp, nan_in, mask))
        assert not bool(m["update_ok"]) and not np.isfinite(float(m["loss"]))
        assert int(state.skips) == skips
        assert _tree_equal(jax.device_get(state.params), start)  # nothing applied

    nan_out, mask_out = adv.copy(), mask.copy()
    nan_out[0], mask_out[0] = np.nan, 0.0  # NaN only on a fully masked-out rollout: harmless
    state, m = fns.update(state, _batch(exp, nan_out, mask_out))
    assert bool(m["update_ok"]) and np.isfinite(float(m["loss"])) and int(state.skips) == 0
    assert not _tree_equal(jax.device_get(state.params), start)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))


@pytest.mark.slow
def test_hung_and_crashing_verifiers_score_wrong_are_counted_and_training_goes_on(built):
    exp, fns = built
    R = exp.config.rollout.prompts_per_step * exp.config.rollout.rollouts_per_prompt
    verifier = rewards.RewardFn(
        rewards.RewardConfig(
            task="math", timeout_s=0.5, num_workers=2, checker="faulty_checker:check"
        )
    )
    tags = ("hang", "die", "raise", None)  # None: the gold answer, verified correct
    scored = []

    def reward_fn(texts, golds):  # the policy's completions, dressed as faults for the checker
        dressed = ["\\boxed{%s}" % (tags[i % 4] or g) for i, g in enumerate(golds)]
        scored.append(verifier(dressed, golds))
        return scored[-1]

    faulty = dataclasses.replace(exp, reward_fn=reward_fn)  # Experiment is immutable
    try:
        run, _ = steps.init_run(faulty, warm_start=False)
        source = faulty.make_source()
        for step in (1, 2):
            result = train.rl_step(faulty, fns, run, source)
            run, row = result.run, result.row
            assert int(run.train.step) == step
            rewards_, correct, _ = scored[-1]
            np.testing.assert_array_equal(correct, np.arange(R) % 4 == 3)
            np.testing.assert_array_equal(rewards_, np.where(np.arange(R) % 4 == 3, 1.0, -1.0))
            assert row["reward/num_timeouts"] == R // 4
            assert row["reward/num_crashes"] == R // 2  # the worker died, or the check raised
            assert row["reward_mean"] == pytest.approx(-0.5) and row["pass_rate"] == 0.25
            assert np.isfinite(row["loss"]) and row["skipped_updates"] == 0
    finally:
        verifier.close()


# ============================================================================ bad input


def _cli(args, workdir, env=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "experiments.run", *args, f"--workdir={workdir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def _the_error_line(out, returncode=2):
    """The single non-log stderr line of a failed run (asserts there is exactly one)."""
    assert out.returncode == returncode, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [l for l in out.stderr.splitlines() if l.strip() and not _LOG_LINE.match(l)]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
    return lines[0]


def _gsm8k_dir(root, bad_row=False):
    """A user's own data directory in the GSM8K layout (3 good rows; optionally one without answer)."""
    folder = root / "gsm8k"
    folder.mkdir(parents=True)
    rows = [
        {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        for a, b in [(2, 3), (4, 5), (6, 7)]
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (folder / "train.jsonl").write_text(
        text + ('{"question": "What is 1 + 1?"}\n' if bad_row else "")
    )
    (folder / "test.jsonl").write_text(text)
    return str(root)


_BAD_INPUT = {  # name: (config argument, overrides, what the one line must say)
    "value of the wrong type": (
        "grpo",
        ["--config.steps=abc"],
        ["--config.steps=abc", "takes a value of type int", "--config.steps=3"],
    ),
    "unknown key, nothing close": (
        "grpo",
        ["--config.zzz_qqq=1"],
        ["unknown config key config.zzz_qqq", "configs/common.py"],
    ),
    "value outside its choices": (
        "grpo",
        ["--config.algorithm.name=grpo2"],
        ["config.algorithm.name='grpo2' is not one of"],
    ),
    "n_min < 2": (
        "rollout_gdro",
        ["--config.gdro.rollout.n_min=1"],
        ["config.gdro.rollout: RolloutGDROConfig.n_min must be >= 2", "got 1"],
    ),
    "mesh vs devices": (
        "grpo",
        ["--config.mesh.num_devices=2", "--config.mesh.data=4"],
        ["config.mesh", "needs 4 devices but 2 are available", "config.mesh.data/fsdp/tensor"],
    ),
    "batch vs mesh": (
        "grpo",
        [
            "--config.mesh.num_devices=2",
            "--config.mesh.data=2",
            "--config.rollout.prompts_per_step=3",
            "--config.rollout.rollouts_per_prompt=3",
        ],
        ["= 9 rollouts do not divide", "make R a multiple of 2"],
    ),
    "missing dataset directory": (
        "grpo",
        ["--config.data.name=gsm8k", "--config.data.source_dir=/nonexistent/data"],
        ["dataset 'gsm8k'", "/nonexistent/data", "data.source_dir"],
    ),
    "conflicting testbed flags": (
        "grpo,heavy_tailed,long",
        [],
        ["config arguments 'heavy_tailed' and 'long' cannot be combined"],
    ),
    "missing config file": (
        None,
        ["--config=configs/no_such_config.py:grpo"],
        ["no_such_config.py", "--config=configs/arithmetic.py:grpo"],
    ),
}


@pytest.mark.parametrize("case", list(_BAD_INPUT))
def test_bad_input_is_one_error_line_and_leaves_nothing_behind(tmp_path, case):
    algorithm, overrides, expected = _BAD_INPUT[case]
    config = [] if algorithm is None else [f"--config=configs/arithmetic.py:{algorithm},smoke"]
    line = _the_error_line(_cli(config + _CLI_SMOKE + overrides, tmp_path / "run"))
    for text in expected:
        assert text in line, line
    # nothing ran, so the corrected command is not refused as "a run with another config"
    assert not (tmp_path / "run" / "config.json").exists()


def test_missing_tokenizer_and_dataset_row_without_answer_are_one_line_errors(tmp_path):
    good = _gsm8k_dir(tmp_path / "good")
    line = _the_error_line(
        _cli(
            [
                "--config=configs/arithmetic.py:grpo,smoke",
                *_CLI_SMOKE,
                "--config.data.name=gsm8k",
                f"--config.data.source_dir={good}",
                "--config.model.gguf_path=/nonexistent/model.gguf",
            ],
            tmp_path / "a",
        )
    )
    assert (
        "config.model.gguf_path" in line and "GGUF file not found: /nonexistent/model.gguf" in line
    )

    bad = _gsm8k_dir(tmp_path / "bad", bad_row=True)
    line = _the_error_line(
        _cli(
            [
                "--config=configs/arithmetic.py:grpo,smoke",
                *_CLI_SMOKE,
                "--config.data.name=gsm8k",
                f"--config.data.source_dir={bad}",
            ],
            tmp_path / "b",
        )
    )
    assert f"bad row at {bad}/gsm8k/train.jsonl:4: missing or empty 'answer'" in line
    assert "--config.data.bad_rows=skip" in line


def test_workdir_with_another_run_is_refused_and_left_untouched(tmp_path):
    other = smoke_config("grpo")
    other.optimizer.learning_rate = 0.5
    config_utils.check_workdir(other, str(tmp_path))
    before = (tmp_path / "config.json").read_text()
    line = _the_error_line(
        _cli(["--config=configs/arithmetic.py:grpo,smoke", *_CLI_SMOKE], tmp_path)
    )
    lr = smoke_config("grpo").optimizer.learning_rate
    assert (
        f"{tmp_path} holds a run with another config (optimizer.learning_rate: 0.5 -> {lr})" in line
    )
    assert "--config.checkpoint.overwrite=True" in line
    assert (tmp_path / "config.json").read_text() == before


def test_bad_rows_skipped_are_counted(tmp_path, monkeypatch):
    cfg = smoke_config(
        "grpo",
        **{
            "data.name": "gsm8k",
            "data.bad_rows": "skip",
            "data.source_dir": _gsm8k_dir(tmp_path, bad_row=True),
            "data.max_prompt_tokens": 64,
            "rollout.prompts_per_step": 3,  # of the 3 good rows
            "eval.datasets": ("gsm8k",),
            "reward.num_workers": 1,
        },
    )
    # the data path under test, without loading real weights: the character tokenizer
    monkeypatch.setattr(
        model_from_config, "load_tokenizer", lambda config: tokenizer_lib.CharTokenizer()
    )
    exp = experiment.build_experiment(cfg)
    try:
        assert exp.pool.stats["bad_rows_skipped"] == 1 and exp.pool.stats["train_examples"] == 3
        assert exp.curriculum.num_prompts == 3
    finally:
        exp.close()


@pytest.mark.parametrize("mode", ["skip", "truncate"])
def test_overlong_prompts_are_skipped_or_truncated_and_counted(mode):
    budget = _BUDGET
    cfg = smoke_config("grpo", **{"data.max_prompt_tokens": budget, "data.overlong_prompts": mode})
    exp = experiment.build_experiment(cfg)
    exp.close()
    # independently: the arithmetic prompt is problem + "=", one token per character
    train_set, _ = arithmetic.make_arithmetic(
        arithmetic.ArithmeticConfig(**cfg.data.arithmetic.to_dict())
    )
    over = sum(len(ex["problem"]) + 1 > budget for ex in train_set)
    assert 0 < over < len(train_set)
    skipped = over if mode == "skip" else 0
    assert exp.pool.stats == {
        "train_examples": len(train_set),
        "overlong_prompts": over,
        "overlong_prompts_skipped": skipped,
        "bad_rows_skipped": 0,
        "prompt_tokens_padded_to": budget,
    }
    assert exp.curriculum.num_prompts == len(train_set) - skipped
    assert exp.pool.tokens.shape == (len(train_set) - skipped, budget)


# ============================================================================ process death, end to end

# One Rollout-GDRO configuration (the most controller state) for every end-to-end fault; the
# prompt budget makes some prompts overlong, so their count must reach the summary too.
_E2E = [
    "--config=configs/arithmetic.py:rollout_gdro,smoke",
    *_CLI_SMOKE,
    "--config.steps=6",
    f"--config.data.max_prompt_tokens={_BUDGET}",
]


@pytest.fixture(scope="module")
def cli_env():
    """The runs' environment: with the session's persistent compilation cache (conftest.py)."""
    assert os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return dict(os.environ, PYTHONUNBUFFERED="1")


class _Run:
    """`python -m experiments.run` in the background; stdout/stderr go to files (no pipe stalls).
    ``args``: the flags before ``extra`` (default `_E2E`)."""

    def __init__(self, workdir, env, extra, tag, args=None):
        args = _E2E if args is None else args
        self.out_path, self.err_path = f"{workdir}.{tag}.out", f"{workdir}.{tag}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "experiments.run", *args, *extra, f"--workdir={workdir}"],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=err,
            )

    def wait(self, timeout=900):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    @property
    def out(self):
        return open(self.out_path).read()

    @property
    def err(self):
        return open(self.err_path).read()


def _complete_steps(workdir):
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit())


def _saved_state(workdir, step):
    """The raw saved state tree (numpy-comparable arrays), read without a template."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sharding info not provided")
        return ocp.PyTreeCheckpointer().restore(
            os.path.join(workdir, "checkpoints", str(step), "state")
        )


def _assert_same_run(reference, workdir):
    """Metrics, samples, evaluation and the final state (params, optimizer, RNG, controllers)
    are identical (`workdirs.differences` compares every file, where the configs are equal)."""
    a, b = deterministic_rows(str(reference)), deterministic_rows(str(workdir))
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(7))
    assert a == b
    _assert_same_samples(reference, workdir)
    sa = json.load(open(os.path.join(reference, "summary.json")))
    sb = json.load(open(os.path.join(workdir, "summary.json")))
    assert sa["eval_after"] == sb["eval_after"] and sa["data"] == sb["data"]
    ta, tb = _saved_state(reference, 6), _saved_state(workdir, 6)
    assert jax.tree.structure(ta) == jax.tree.structure(tb)
    assert _tree_equal(ta, tb)


def _assert_same_samples(reference, workdir):
    a = writers.read_jsonl(str(reference / "samples.jsonl"))
    b = writers.read_jsonl(str(workdir / "samples.jsonl"))
    assert [r["step"] for r in b] == [r["step"] for r in a] == sorted(r["step"] for r in a)
    assert sorted({r["step"] for r in a}) == list(range(1, 7))
    assert a == b


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cli_env):
    """The uninterrupted run every interrupted one must reproduce."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    run = _Run(workdir, cli_env, ["--config.checkpoint.every_steps=1"], "straight")
    assert run.wait() == 0, run.err[-3000:]
    return workdir


@pytest.mark.slow
def test_reference_run_reports_the_overlong_prompts(reference):
    summary = json.load(open(reference / "summary.json"))
    cfg = smoke_config("rollout_gdro")
    train_set, _ = arithmetic.make_arithmetic(
        arithmetic.ArithmeticConfig(**cfg.data.arithmetic.to_dict())
    )
    over = sum(len(ex["problem"]) + 1 > _BUDGET for ex in train_set)
    assert (
        summary["data"]["overlong_prompts"]
        == summary["data"]["overlong_prompts_skipped"]
        == over
        > 0
    )
    (row0,) = [r for r in writers.read_jsonl(str(reference / "metrics.jsonl")) if r["step"] == 0]
    assert row0["data/overlong_prompts"] == over


@pytest.mark.slow
def test_sigterm_checkpoints_exits_0_and_the_resumed_run_is_identical(tmp_path, cli_env, reference):
    workdir = tmp_path / "run"
    args = ["--config.checkpoint.every_steps=100"]  # only SIGTERM and the end write checkpoints
    run = _Run(workdir, cli_env, args, "interrupted")
    wait_for_training_row(workdir, 3, [run.proc], timeout=900)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 0, run.err[-3000:]
    # on a fast machine the signal can land in the last step's (final) evaluation: then that
    # step's checkpoint is written with the evaluation pending, and the resume redoes it
    m = re.search(
        r"SIGTERM(?:: checkpoint written at step (\d+); exiting| during the evaluation after "
        r"step \d+: checkpoint written at step (\d+))",
        run.out,
    )
    stopped = int(m.group(1) or m.group(2))
    assert 3 <= stopped <= 6
    assert _complete_steps(workdir)[-1] == stopped
    assert not (workdir / "summary.json").exists()

    resumed = _Run(workdir, cli_env, args, "resumed")
    assert resumed.wait() == 0, resumed.err[-3000:]
    assert f"Resuming from checkpoint at step {stopped} in" in resumed.out
    _assert_same_run(reference, workdir)


def _kill_while_saving(proc, checkpoints, step, timeout=900):
    """SIGKILLs `proc` the moment Orbax's temporary directory for `step` appears."""
    want, t0 = f"{step}{checkpointing.TMP_MARK}", time.monotonic()
    while proc.poll() is None:
        if time.monotonic() - t0 > timeout:
            proc.kill()
            pytest.fail(f"no save of step {step} within {timeout} s")
        try:
            names = os.listdir(checkpoints)
        except FileNotFoundError:
            names = []
        if any(n.startswith(want) for n in names):
            proc.kill()
            proc.wait()
            return
        time.sleep(0.001)
    pytest.fail(f"the run ended (rc={proc.returncode}) before saving step {step}")


@pytest.mark.slow
def test_sigkill_mid_save_and_a_corrupted_latest_checkpoint_lose_nothing(
    tmp_path, cli_env, reference
):
    workdir = tmp_path / "run"
    checkpoints = workdir / "checkpoints"
    args = ["--config.checkpoint.every_steps=1"]
    expect = None  # (last complete step, a partial save was left) after the previous kill
    partial_seen = 0
    for n, target in enumerate((2, 4, 5)):
        if n == 2 and partial_seen:
            break  # two kills, at least one of them mid-save: enough
        run = _Run(workdir, cli_env, args, f"killed{n}")
        _kill_while_saving(run.proc, checkpoints, target)
        if expect is not None:
            _assert_resumed(run.out, *expect)
        partial = [x for x in os.listdir(checkpoints) if checkpointing.TMP_MARK in x]
        partial_seen += bool(partial)
        expect = (_complete_steps(workdir)[-1], bool(partial))
        assert expect[0] < target + (not partial)  # the interrupted step is never taken as complete
    assert partial_seen, "no kill landed inside a save"

    final = _Run(workdir, cli_env, args, "completed")
    assert final.wait() == 0, final.err[-3000:]
    _assert_resumed(final.out, *expect)
    assert not [x for x in os.listdir(checkpoints) if checkpointing.TMP_MARK in x]
    _assert_same_run(reference, workdir)
    assert workdir_differences(reference, workdir) == []  # every file

    # Now damage the newest checkpoint (silently: flipped bits) and run the same command again.
    _corrupt(str(checkpoints / "6"), "flip_bits")
    again = _Run(workdir, cli_env, args, "after_corruption")
    assert again.wait() == 0, again.err[-3000:]
    warnings = _warnings(again.out)
    assert any(
        "checkpoint 6 in" in w
        and "checksum mismatch" in w
        and w.endswith("falling back to checkpoint 5")
        for w in warnings
    ), warnings
    assert "Resuming from checkpoint at step 5 in" in again.out
    assert (checkpoints / ("6" + checkpointing.UNREADABLE_SUFFIX)).is_dir()
    _assert_same_run(reference, workdir)


def _assert_resumed(out, step, partial):
    assert f"Resuming from checkpoint at step {step} in" in out, out[-3000:]
    if partial:
        assert any(
            "incomplete checkpoint(s)" in w and "from an interrupted save" in w
            for w in _warnings(out)
        ), out[-3000:]


@pytest.mark.slow
def test_nonfinite_updates_stop_the_run_with_one_line_after_checkpointing_finite_params(
    tmp_path, cli_env
):
    workdir = tmp_path / "run"
    out = _cli(
        [
            "--config=configs/arithmetic.py:grpo,smoke",
            *_CLI_SMOKE,
            "--config.steps=8",
            "--config.optimizer.max_consecutive_skips=2",
            "--config.optimizer.learning_rate=inf",
        ],  # every update overflows
        workdir,
        env=cli_env,
    )
    line = _the_error_line(out, returncode=1)
    assert line.startswith(
        "error: step 2: 2 consecutive updates had a non-finite loss, gradient or update"
    )
    assert "config.optimizer.learning_rate" in line and str(workdir / "checkpoints") in line
    rows = [r for r in writers.read_jsonl(str(workdir / "metrics.jsonl")) if r["step"] > 0]
    assert [(r["step"], r["skipped_updates"], r["consecutive_skips"]) for r in rows] == [
        (1, 1, 1),
        (2, 1, 2),
    ]
    assert _complete_steps(workdir)[-1] == 2 and not (workdir / "summary.json").exists()
    start, last = _saved_state(workdir, 0)["train"], _saved_state(workdir, 2)["train"]
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(last["params"]))
    assert _tree_equal(last["params"], start["params"])  # the last good parameters


# ============================================================================ one run per workdir, signals, drift, disks
# (docs/reliability.md tabulates these; `test_reliability_table_names_existing_tests` checks it)


def test_second_run_on_a_locked_workdir_is_refused_naming_the_holder(tmp_path):
    first = checkpointing.WorkdirLock(str(tmp_path)).acquire()
    try:
        holder = json.loads((tmp_path / ".lock").read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(checkpointing.WorkdirError, match="is in use by another run") as e:
            checkpointing.WorkdirLock(str(tmp_path)).acquire()  # another open file: refused
        assert f"pid {os.getpid()} on " in str(e.value) and "\n" not in str(e.value)
    finally:
        first.release()
    checkpointing.WorkdirLock(str(tmp_path)).acquire().release()  # released: free again


def test_stale_lock_of_a_dead_process_is_reported_and_taken_over(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".lock").write_text(
        json.dumps({"pid": dead.pid, "host": __import__("socket").gethostname(), "started": 0})
    )
    lock = checkpointing.WorkdirLock(str(tmp_path)).acquire()
    lock.release()
    (warning,) = _warnings(capsys.readouterr().out)
    assert "taking over the stale lock" in warning and f"pid {dead.pid}" in warning
    assert "no longer running" in warning


def _fake_checkpoint(workdir, step, config):
    meta = workdir / "checkpoints" / str(step) / "meta"
    meta.mkdir(parents=True)
    (meta / "metadata").write_text(json.dumps({"config": config.to_dict()}, default=list))


def test_config_drift_is_refused_with_the_diff_unless_allowed(tmp_path):
    cfg = smoke_config("grpo")
    config_utils.check_workdir(cfg, str(tmp_path))
    _fake_checkpoint(tmp_path, 3, cfg)
    changed = smoke_config("grpo", **{"reward.format_reward": 0.5, "algorithm.kl_coef": 0.1})
    with pytest.raises(ConfigError) as e:
        config_utils.check_workdir(changed, str(tmp_path))
    line = str(e.value)
    assert "algorithm.kl_coef: 0.0 -> 0.1; reward.format_reward: 0.0 -> 0.5" in line
    assert "--allow_changes=algorithm.kl_coef,reward.format_reward" in line and "\n" not in line
    with pytest.raises(ConfigError, match="algorithm.kl_coef"):  # both must be named
        config_utils.check_workdir(changed, str(tmp_path), allow_changes=["reward"])
    # every safe field at once is not a different run
    safe = smoke_config(
        "grpo",
        steps=50,
        **{
            "checkpoint.every_steps": 7,
            "checkpoint.keep": 9,
            "logging.every_steps": 2,
            "eval.every_steps": 5,
            "reward.timeout_s": 1.0,
            "reward.num_workers": 3,
            "data.source_dir": "/elsewhere",
        },
    )
    assert config_utils.check_workdir(safe, str(tmp_path)) == []
    # with config.json gone, the copy in the newest checkpoint is compared
    os.remove(tmp_path / "config.json")
    other = smoke_config("grpo", **{"optimizer.learning_rate": 0.5})
    with pytest.raises(ConfigError, match="optimizer.learning_rate: 0.0001 -> 0.5"):
        config_utils.check_workdir(other, str(tmp_path))
    assert not (tmp_path / "config.json").exists()
    allowed = config_utils.check_workdir(
        changed, str(tmp_path), allow_changes=["reward", "algorithm"]
    )
    assert allowed == ["algorithm.kl_coef: 0.0 -> 0.1", "reward.format_reward: 0.0 -> 0.5"]
    assert json.loads((tmp_path / "config.json").read_text())["reward"]["format_reward"] == 0.5
    # the length of a cosine schedule is part of the trajectory
    cos = smoke_config("grpo", **{"optimizer.schedule": "cosine"})
    assert config_utils.config_changes(
        cos.to_dict(), smoke_config("grpo", steps=9, **{"optimizer.schedule": "cosine"}).to_dict()
    ) == [("steps", 3, 9)]


_BAD_VALUES = [  # (field, value): each is refused by validate, naming the field
    ("seed", -3),
    ("optimizer.learning_rate", -1e-4),
    ("optimizer.learning_rate", float("nan")),
    ("optimizer.b2", 1.0),
    ("optimizer.warmup_steps", -1),
    ("optimizer.max_consecutive_skips", 0),
    ("sft.steps", -1),
    ("sft.batch_size", 0),
    ("sft.learning_rate", -1.0),
    ("rollout.top_k", -1),
    ("rollout.generate_batch_size", -8),
    ("eval.top_k", -5),
    ("eval.top_p", 1.5),
    ("eval.max_new_tokens", -1),
    ("eval.max_examples", -1),
    ("eval.every_steps", -2),
    ("algorithm.kl_coef", -0.1),
    ("algorithm.epsilon_low", -0.2),
    ("algorithm.dual_clip", 0.5),
    ("algorithm.mini_batch_size", -4),
    ("data.max_train_examples", -1),
    ("checkpoint.keep", 0),
    ("reward.timeout_s", 0.0),
    ("reward.num_workers", 0),
    ("mesh.fsdp", 0),
    ("mesh.data", 0),
    ("ppo.gamma", 1.5),
    ("model.preset", "no_such_preset"),
    ("model.overrides.hiden_size", 64),
    ("rollout.temperature", 0.0),
]


@pytest.mark.parametrize("field,value", _BAD_VALUES, ids=[f"{f}={v}" for f, v in _BAD_VALUES])
def test_values_that_cannot_run_are_refused_before_any_work(field, value):
    cfg = smoke_config("grpo")
    if field.startswith("model.overrides."):
        cfg.model.overrides[field.split(".")[-1]] = value
    else:
        cfg = smoke_config("grpo", **{field: value})
    with pytest.raises(ConfigError) as e:
        config_utils.validate(cfg)
    assert f"config.{field}" in str(e.value) and "\n" not in str(e.value)


def test_evaluation_batches_that_do_not_divide_over_the_mesh_are_refused_at_start(tmp_path):
    cfg = smoke_config("grpo", **{"eval.batch_size": 3, "eval.num_samples": 3})
    cfg.mesh.num_devices, cfg.mesh.data = 2, 2
    with pytest.raises(ConfigError, match="config.eval: .* = 3 rows"):
        train.train_and_evaluate(cfg, str(tmp_path))
    assert not (tmp_path / "config.json").exists() and not (tmp_path / "checkpoints").exists()


def test_workdir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    line = _the_error_line(
        _cli(["--config=configs/arithmetic.py:grpo,smoke", *_CLI_SMOKE], tmp_path / "afile"), 1
    )
    assert f"workdir {tmp_path / 'afile'} is a file" in line
    line = _the_error_line(
        _cli(["--config=configs/arithmetic.py:grpo,smoke", *_CLI_SMOKE], tmp_path / "afile" / "x"),
        1,
    )
    assert f"workdir {tmp_path / 'afile' / 'x'} is not writable: Not a directory" in line


def _mount_tmpfs(path, options):
    path.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    if out.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({out.stderr.decode().strip()[:200]})")
    return path


def _umount(path):
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_read_only_checkpoint_directory_is_one_line_at_start(tmp_path):
    workdir = tmp_path / "run"
    ro = _mount_tmpfs(workdir / "checkpoints", "size=1m,ro")
    try:
        line = _the_error_line(
            _cli(["--config=configs/arithmetic.py:grpo,smoke", *_CLI_SMOKE], workdir), 1
        )
        assert f"checkpoint directory {ro} is not writable: Read-only file system" in line
        assert not (workdir / "metrics.jsonl").exists()
    finally:
        _umount(ro)


# A subprocess that sends itself a signal from inside a phase (the n-th call of a function the
# loop calls), then runs the real function: the signal lands in the middle of that phase.
_SIGNAL_IN = """
import os, runpy, signal, sys
target, signame, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
del sys.argv[1:4]
from grpo_jax import evaluation, steps
module = {"warmstart": steps, "evaluate": evaluation}[target]
name = {"warmstart": "supervised_warmstart", "evaluate": "evaluate"}[target]
real, calls = getattr(module, name), [0]
def wrapped(*args, **kwargs):
    calls[0] += 1
    if calls[0] == nth:
        os.kill(os.getpid(), getattr(signal, signame))
    return real(*args, **kwargs)
setattr(module, name, wrapped)
sys.argv[0] = "experiments/run.py"
runpy.run_module("experiments.run", run_name="__main__", alter_sys=True)
"""


def _run_with_signal(workdir, env, target, signame, nth, extra=()):
    return subprocess.run(
        [
            sys.executable,
            "-c",
            _SIGNAL_IN,
            target,
            signame,
            str(nth),
            *_E2E,
            *extra,
            f"--workdir={workdir}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "target,signame,code", [("warmstart", "SIGTERM", 0), ("evaluate", "SIGINT", 130)]
)
def test_signal_in_the_warm_start_or_first_evaluation_saves_nothing_and_the_rerun_is_identical(
    tmp_path, cli_env, reference, target, signame, code
):
    workdir = tmp_path / "run"
    args = ["--config.checkpoint.every_steps=1"]
    out = _run_with_signal(workdir, cli_env, target, signame, 1, args)
    assert out.returncode == code, out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout
    lines = [l for l in out.stdout.splitlines() if l.strip()]
    assert lines == [
        f"{signame} during the set-up, warm start or first evaluation: nothing new was saved; "
        "rerun the same command to continue; exiting."
    ], out.stdout
    assert _complete_steps(workdir) == [] and not (workdir / "metrics.jsonl").exists()
    rerun = _Run(workdir, cli_env, args, "rerun")
    assert rerun.wait() == 0, rerun.err[-3000:]
    _assert_same_run(reference, workdir)
    assert workdir_differences(reference, workdir) == []  # every file


@pytest.mark.slow
def test_sigterm_in_an_evaluation_inside_the_loop_and_the_final_one_resume_to_the_same_run(
    tmp_path, cli_env, reference
):
    workdir = tmp_path / "run"
    args = ["--config.checkpoint.every_steps=100", "--config.eval.every_steps=2"]
    # evaluate call 1 = "before", 2 = after step 2
    out = _run_with_signal(workdir, cli_env, "evaluate", "SIGTERM", 2, args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout
    assert (
        "SIGTERM during the evaluation after step 2: checkpoint written at step 2 (the "
        "evaluation is redone on resume); exiting." in out.stdout
    )
    assert _complete_steps(workdir) == [0, 2]
    assert [r["step"] for r in writers.read_jsonl(str(workdir / "metrics.jsonl"))] == [0, 1]
    # the resumed run is interrupted again, in the final evaluation (calls: step 2, 4, final)
    out = _run_with_signal(workdir, cli_env, "evaluate", "SIGTERM", 3, args)
    assert out.returncode == 0, out.stderr[-3000:]
    # the final evaluation is the last step's evaluation: its checkpoint is kept, it is redone
    assert "SIGTERM during the evaluation after step 6: checkpoint written at step 6" in out.stdout
    assert not (workdir / "summary.json").exists()
    final = _Run(workdir, cli_env, args, "final")
    assert final.wait() == 0, final.err[-3000:]
    rows = writers.read_jsonl(str(workdir / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(7))
    assert [r["step"] for r in rows if "eval/mean_at_1" in r] == [0, 2, 4, 6]  # 6: the final one
    # apart from the extra evaluations, the same run as the uninterrupted one
    strip = lambda rs: [
        {k: v for k, v in r.items() if r["step"] == 0 or not k.startswith("eval/")} for r in rs
    ]
    assert strip(deterministic_rows(str(workdir))) == strip(deterministic_rows(str(reference)))
    # the samples of the steps whose evaluation was interrupted (2 and 6) are kept too
    _assert_same_samples(reference, workdir)
    sa = json.load(open(reference / "summary.json"))
    sb = json.load(open(workdir / "summary.json"))
    assert sa["eval_after"] == sb["eval_after"]
    assert _tree_equal(_saved_state(reference, 6), _saved_state(workdir, 6))


@pytest.mark.slow
def test_two_runs_on_one_workdir_the_second_is_refused_and_the_first_is_unharmed(
    tmp_path, cli_env, reference
):
    workdir = tmp_path / "run"
    first = _Run(workdir, cli_env, ["--config.checkpoint.every_steps=1"], "first")
    t0 = time.monotonic()
    while not (workdir / ".lock").exists() or not (workdir / ".lock").read_text().strip():
        assert first.proc.poll() is None and time.monotonic() - t0 < 300, first.err[-3000:]
        time.sleep(0.05)
    second = _cli([*_E2E, "--config.checkpoint.every_steps=1"], workdir, env=cli_env)
    line = _the_error_line(second, 1)
    assert f"{workdir} is in use by another run (pid {first.proc.pid} on " in line
    assert first.wait() == 0, first.err[-3000:]
    _assert_same_run(reference, workdir)  # nothing mixed: the first run's results, alone


@pytest.mark.slow
def test_changed_reward_on_resume_is_refused_also_without_config_json(tmp_path, cli_env, reference):
    workdir = tmp_path / "run"
    shutil.copytree(reference, workdir)
    args = [*_E2E, "--config.checkpoint.every_steps=1"]
    line = _the_error_line(_cli([*args, "--config.reward.format_reward=0.5"], workdir, env=cli_env))
    assert "holds a run with another config (reward.format_reward: 0.0 -> 0.5)" in line
    os.remove(workdir / "config.json")  # the copy in the checkpoint is compared instead
    line = _the_error_line(
        _cli([*args, "--config.optimizer.learning_rate=0.5"], workdir, env=cli_env)
    )
    assert "optimizer.learning_rate: 0.0001 -> 0.5" in line
    assert _complete_steps(workdir) == _complete_steps(reference)
    out = _cli(
        [
            *args,
            "--config.reward.format_reward=0.5",
            "--config.steps=7",
            "--allow_changes=reward.format_reward",
        ],
        workdir,
        env=cli_env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "continuing with config changes allowed by --allow_changes" in out.stdout
    meta = json.load(open(workdir / "checkpoints" / "7" / "meta" / "metadata"))
    assert meta["config"]["reward"]["format_reward"] == 0.5
    assert meta["config_changes"] == [{"step": 6, "changes": ["reward.format_reward: 0.0 -> 0.5"]}]


@pytest.mark.slow
def test_save_on_a_full_disk_is_one_line_and_the_workdir_resumes(tmp_path, cli_env, reference):
    disk = _mount_tmpfs(tmp_path / "disk", "size=3m")  # two of the run's checkpoints fit
    try:
        workdir = disk / "run"
        args = ["--config.checkpoint.every_steps=1"]
        run = _Run(workdir, cli_env, args, "full")
        assert run.wait() == 1, run.err[-3000:]
        err = [l for l in run.err.splitlines() if l.strip() and not _LOG_LINE.match(l)]
        assert len(err) == 1 and "Traceback" not in run.err, run.err[-3000:]
        (line,) = err
        assert re.match(
            rf"error: cannot save checkpoint (\d+) in {workdir}/checkpoints: No space left on "
            r"device \(errno 28\); the last complete checkpoint \((\d+)\) is intact",
            line,
        ), line
        last = _complete_steps(workdir)[-1]
        assert f"({last}) is intact" in line
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed = _Run(workdir, cli_env, args, "resumed")
        assert resumed.wait() == 0, resumed.err[-3000:]
        assert f"Resuming from checkpoint at step {last} in" in resumed.out
        _assert_same_run(reference, workdir)
    finally:
        _umount(disk)


def test_reliability_table_names_existing_tests():
    """Every row of docs/reliability.md names a test that exists (in any test file); every test
    here (and in tests/test_signal_stress.py and tests/test_disaggregated.py) has a row."""
    table = open(os.path.join(REPO, "docs", "reliability.md")).read()
    rows = [l for l in table.splitlines() if l.startswith("| ") and "`test_" in l]
    named = {n for l in rows for n in re.findall(r"`(test_\w+)`", l)}
    files = glob.glob(os.path.join(REPO, "tests", "test_reliability*.py"))
    files += [
        os.path.join(REPO, "tests", f"test_{n}.py") for n in ("signal_stress", "disaggregated")
    ]
    sources = "".join(open(p).read() for p in files)
    defined = set(re.findall(r"^def (test_\w+)", sources, re.M))
    every = "".join(open(p).read() for p in glob.glob(os.path.join(REPO, "tests", "test_*.py")))
    exist = set(re.findall(r"^def (test_\w+)", every, re.M))
    assert named and named <= exist, named - exist
    assert defined - {"test_reliability_table_names_existing_tests"} <= named, defined - named


def test_a_field_added_since_an_older_run_is_its_default_on_resume(tmp_path):
    """An older workdir's config.json lacks the sections added since (here env.*): they count
    as their defaults, so the run resumes; a non-default value of such a field is a change."""
    old = smoke_config("grpo").to_dict()
    del old["env"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert config_utils.check_workdir(smoke_config("grpo"), str(tmp_path)) == []
    with pytest.raises(ConfigError, match=r"env.name: '' -> 'calculator'"):
        config_utils.check_workdir(
            smoke_config("grpo", **{"env.name": "calculator"}), str(tmp_path)
        )
