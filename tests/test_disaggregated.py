"""The two-group run (`grpo_jax.disaggregated`, docs/disaggregated.md): process 0 trains,
process 1 generates, one CPU device each, joined by `jax.distributed`; weights go over the
weight channel, rollouts over the rollout stream, work orders through the key-value store.

It must follow `python -m experiments.run` on one process with the same
``rollout.max_staleness = 1`` step for step: the same metrics rows bit for bit (both groups'
devices are one CPU device each, as the single run's mesh: the same programs, no tolerance)
and the same checkpointed states (the batches in flight drained into them), across a restart
of both processes that resumes from the checkpoint.
"""

import os
import subprocess
import sys

import pytest
from processes import finish, free_port
from workdirs import _same_tree, _state, untimed

from grpo_jax import disaggregated, writers
from grpo_jax.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the smoke config with k = 1; a warm start that teaches the answer format and a format bonus
# give a group's rollouts different rewards (non-zero advantages: the parameters move)
ARGS = [
    "--config=configs/arithmetic.py:grpo,smoke",
    "--config.mesh.num_devices=1",
    "--config.logging.tensorboard=False",
    "--config.rollout.max_staleness=1",
    "--config.algorithm.tis_cap=2.0",
    "--config.checkpoint.every_steps=2",
    "--config.sft.steps=30",
    "--config.sft.learning_rate=3e-3",
    "--config.sft.batch_size=32",
    "--config.reward.format_reward=0.5",
    "--config.eval.max_examples=4",
    # evaluation samples as the training sampler does (same rows, same settings): one program
    "--config.eval.batch_size=32",
    "--config.eval.temperature=1.0",
    "--config.eval.top_k=0",
    "--config.eval.top_p=1.0",
]


def _start(workdir, steps, tmp_path, *extra):
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1 "
        + os.environ.get("GRPO_JAX_TEST_COMPILE_FLAGS", ""),
        "JAX_PLATFORMS": "cpu",
        # shared by the three kinds of process and both phases: one compile per program
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    args = [sys.executable, "-m", "experiments.run", *ARGS]
    args += [f"--workdir={workdir}", f"--config.steps={steps}", *extra]
    return subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _pair(workdir, steps, tmp_path):
    port = free_port()
    flags = [f"--coordinator_address=localhost:{port}", "--num_processes=2"]
    flags.append("--distributed_timeout_s=120")
    return [
        _start(workdir, steps, tmp_path, *flags, f"--role={role}", f"--process_id={pid}")
        for pid, role in enumerate(("train", "generate"))
    ]


def _rows(workdir):
    """The untimed rows; step 2's without its evaluation (the end of the pair's first phase)."""
    rows = [untimed(r) for r in writers.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("eval/")}
    return [drop(r) if r["step"] == 2 else r for r in rows]


@pytest.mark.slow  # 44-56 s on 2 cores: the one-process run, then the pair twice (a restart)
def test_two_groups_follow_the_single_host_run_step_for_step_across_a_restart(tmp_path):
    single, pair = tmp_path / "single", tmp_path / "pair"
    # one after the other, so the later runs find the programs compiled (2 cores: at once is
    # slower, every process compiling the same programs)
    runs = finish([_start(single, 4, tmp_path)], timeout=300)
    runs += finish(_pair(pair, 2, tmp_path), timeout=300)  # steps 0-1, checkpoint 2
    runs += finish(_pair(pair, 4, tmp_path), timeout=300)  # both restart: resume at step 2
    for rc, out in runs:
        assert rc == 0, out[-3000:]
    first, second = runs[1:3], runs[3:]
    assert "Resuming from checkpoint at step 2" in second[0][1]
    # the generator holds no state: batches 0-2 (order 2 drained into checkpoint 2), then 3-4
    assert "generation group: 3 batches generated" in first[1][1]
    assert "generation group: 2 batches generated" in second[1][1]

    a, b = _rows(single), _rows(pair)
    trained = [r for r in a if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3, 4]
    assert [r["policy_version"] for r in trained] == [0, 0, 1, 2]
    assert any(r["advantage_abs_mean"] > 0 for r in trained)  # the parameters moved
    assert any(r["tis_weight_mean"] != 1.0 for r in trained)  # stale rollouts: TIS acts
    assert a == b  # every row, bit for bit (evaluations included)
    for step in ("2", "4"):  # the checkpoints, batches in flight included
        ref, got = (_state(os.path.join(w, "checkpoints", step)) for w in (single, pair))
        assert "in_flight" in ref and _same_tree(ref, got), f"checkpoint {step} differs"


def test_groups_refuse_what_the_loop_does_not_run():
    class Config:  # the one field `Groups.check` reads
        class rollout:
            max_staleness = 1

    disaggregated.Groups(1, 2).check(Config)
    for t, n, match in [(2, 2, "1 <= T < "), (0, 2, "1 <= T < "), (1, 3, "one training and one")]:
        with pytest.raises(ConfigError, match=match):
            disaggregated.Groups(t, n).check(Config)
    Config.rollout.max_staleness = 0
    with pytest.raises(ConfigError, match="max_staleness >= 1"):
        disaggregated.Groups(1, 2).check(Config)
    assert [disaggregated.Groups(1, 2).role(p) for p in (0, 1)] == ["train", "generate"]


def test_a_generation_process_with_another_config_is_refused():
    # the training process publishes its config; a generator launched with other settings
    # would sample from them while the trainer records its own (silently off-policy)
    from configs import arithmetic

    train_config = arithmetic.get_config("grpo,smoke")
    text = disaggregated._config_text(train_config)
    same = arithmetic.get_config("grpo,smoke")
    same.mesh.num_devices, same.mesh.tensor = 4, 2  # each group lays out its own devices
    disaggregated.check_same_config(text, same)
    for field, value in [("rollout.temperature", 0.3), ("seed", 7), ("model.dtype", "bfloat16")]:
        other = arithmetic.get_config("grpo,smoke")
        section, _, name = field.rpartition(".")
        setattr(other[section] if section else other, name, value)
        with pytest.raises(ConfigError, match=rf"\({field}: .* -> {value!r}, train -> generate\)"):
            disaggregated.check_same_config(text, other)
