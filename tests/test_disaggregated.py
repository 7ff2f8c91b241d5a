"""The two-group run (`grpo_jax.disaggregated`, docs/disaggregated.md): process 0 trains,
process 1 generates, one CPU device each, joined by `jax.distributed`; weights go over the
weight channel, rollouts over the rollout stream, work orders through the key-value store.

It must follow `python -m experiments.run` on one process with the same
``rollout.max_staleness = 1`` step for step: the same metrics rows bit for bit (both groups'
devices are one CPU device each, as the single run's mesh: the same programs, no tolerance)
and the same checkpointed states (the batches in flight drained into them), across a restart
of both processes that resumes from the checkpoint.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from processes import finish, free_port, wait_for_training_row
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


def _pair(workdir, steps, tmp_path, train=(), generate=()):
    """The trainer and the generator (``train`` / ``generate``: extra flags for each)."""
    port = free_port()
    flags = [f"--coordinator_address=localhost:{port}", "--num_processes=2"]
    flags += ["--distributed_timeout_s=120", "--distributed_heartbeat_s=10"]
    return [
        _start(workdir, steps, tmp_path, *flags, f"--role={role}", f"--process_id={pid}", *extra)
        for pid, role, extra in [(0, "train", train), (1, "generate", generate)]
    ]


def _rows(workdir):
    return [untimed(r) for r in writers.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def _one_error_line(out: str) -> str:
    """The process's ``error:`` line; it must be its only one and no stack dump."""
    lines = [x for x in out.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, out[-3000:]
    assert "Traceback" not in out and "stack trace" not in out, out[-3000:]
    return lines[0]


@pytest.mark.slow  # ~25 s on 2 cores: the one-process run, then the pair twice
def test_two_groups_stopped_by_a_signal_to_the_generator_resume_to_the_single_host_run(tmp_path):
    # a SIGTERM to the generation process stops both processes at the trainer's next safe point
    # (a checkpoint with the batch in flight); rerunning both resumes there, and the run equals
    # the one-process run with the same k = 1 step for step
    single, pair, steps = tmp_path / "single", tmp_path / "pair", 8
    # one after the other, so the later runs find the programs compiled (2 cores: at once is
    # slower, every process compiling the same programs)
    runs = finish([_start(single, steps, tmp_path)], timeout=300)
    procs = _pair(pair, steps, tmp_path)
    wait_for_training_row(pair, 1, procs)
    procs[1].send_signal(signal.SIGTERM)
    runs += finish(procs, timeout=300)
    runs += finish(_pair(pair, steps, tmp_path), timeout=300)  # both rerun: resume
    for rc, out in runs:
        assert rc == 0, out[-3000:]
    (_, train1), (_, gen1), (_, train2), (_, gen2) = runs[1:]
    assert "SIGTERM: passed to the training process" in gen1
    assert "the training process stopped (SIGTERM)" in gen1
    assert "the generation process received SIGTERM" in train1
    stop = int(re.search(r"SIGTERM: checkpoint written at step (\d+); exiting", train1)[1])
    assert 1 <= stop < steps, train1[-3000:]  # stopped mid-run
    assert f"Resuming from checkpoint at step {stop}" in train2
    # the generator holds no state: batches 0 .. stop (the last drained into the checkpoint),
    # then the rest of the steps + k
    done = [
        int(re.search(r"generation group: (\d+) batches generated", g)[1]) for g in (gen1, gen2)
    ]
    assert done == [stop + 1, steps - stop], done

    a, b = _rows(single), _rows(pair)
    trained = [r for r in a if "loss" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in trained][:4] == [0, 0, 1, 2]
    assert any(r["advantage_abs_mean"] > 0 for r in trained)  # the parameters moved
    assert any(r["tis_weight_mean"] != 1.0 for r in trained)  # stale rollouts: TIS acts
    assert a == b  # every row, bit for bit (evaluations included)
    for step in {str(stop), str(steps)}:  # the checkpoints, batches in flight included
        if not os.path.isdir(os.path.join(single, "checkpoints", step)):
            continue  # (the single run checkpoints every 2 steps)
        ref, got = (_state(os.path.join(w, "checkpoints", step)) for w in (single, pair))
        assert "in_flight" in ref and _same_tree(ref, got), f"checkpoint {step} differs"


@pytest.mark.slow  # ~10 s
def test_a_generation_process_that_fails_stops_the_trainer_with_one_error_line(tmp_path):
    # the generator refuses its config (differing from the trainer's): one error line, exit 2;
    # the trainer, waiting for its first batch, ends with one error line too (was: SIGABRT and
    # a stack dump when the job's heartbeat timed out, ~90 s later)
    procs = _pair(tmp_path / "w", 4, tmp_path, generate=["--config.rollout.temperature=0.5"])
    (rc_t, out_t), (rc_g, out_g) = finish(procs, timeout=240)
    assert rc_g == 2 and "rollout.temperature: 1.0 -> 0.5" in _one_error_line(out_g), out_g
    line = _one_error_line(out_t)
    assert rc_t == 1, out_t[-3000:]
    assert "the generation process ended before the training run did" in line
    assert "rollout.temperature" in line and "rerun both processes" in line


@pytest.mark.slow  # ~8 s
def test_a_training_process_that_fails_ends_the_generator_cleanly(tmp_path):
    (tmp_path / "file").write_text("")  # a workdir that is a file: the trainer refuses it
    (rc_t, out_t), (rc_g, out_g) = finish(_pair(tmp_path / "file", 4, tmp_path), timeout=240)
    assert rc_t != 0 and _one_error_line(out_t)
    assert rc_g == 1, out_g[-3000:]  # not SIGABRT (134): it left before the trainer's service
    assert "generation group: 0 batches generated; the training process failed" in out_g
    assert "Traceback" not in out_g and "stack trace" not in out_g, out_g[-3000:]


@pytest.mark.slow  # ~20 s: the 10 s heartbeat
def test_a_killed_generator_stops_a_signalled_trainer_with_one_error_line(tmp_path):
    # SIGKILL leaves no word: the trainer, waiting for a batch, finds the generator's heartbeat
    # stopped (--distributed_heartbeat_s=10) and ends with one error line; the SIGTERM it got
    # meanwhile does not leave it waiting (was: ~85 s, then SIGABRT and a stack dump)
    procs = _pair(tmp_path / "w", 400, tmp_path)
    wait_for_training_row(tmp_path / "w", 1, procs)
    procs[1].kill()
    procs[0].send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    (rc_t, out_t), _ = finish(procs, timeout=120)
    assert rc_t == 1 and time.monotonic() - t0 < 60, out_t[-3000:]
    assert "the generation process stopped answering" in _one_error_line(out_t)


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


class _FakeStore:
    """The key-value client calls `disaggregated.Peer` makes, on a dict."""

    def __init__(self):
        self.data = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.data, key
        self.data[key] = value

    def key_value_try_get(self, key):
        if key not in self.data:
            raise RuntimeError(f"NOT_FOUND: {key}")  # as JAX's bare XlaRuntimeError says it
        return self.data[key]


def test_the_trainer_counts_the_generator_dead_only_when_its_heartbeat_stops(monkeypatch):
    store, now = _FakeStore(), [0.0]
    monkeypatch.setattr(disaggregated.weight_channel, "coordination_client", lambda: store)
    monkeypatch.setattr(disaggregated.time, "monotonic", lambda: now[0])
    groups = disaggregated.Groups(1, 2, stale_s=10.0)
    trainer, generator = groups.peer("train"), groups.peer("generate")

    def beats_for(seconds, beat=True):  # the trainer checking every 0.25 s meanwhile
        for _ in range(int(seconds * 4)):
            now[0] += 0.25
            if beat:
                store.data["grpo_jax/run/run/beat/generate"] = str(now[0])
            trainer.check()

    beats_for(60)  # a long generation: beating, never stale
    now[0] += 9.9  # a pause under stale_s
    trainer.check()
    now[0] += 0.2  # 10.1 s without a change: dead
    with pytest.raises(disaggregated.PeerEnded, match="stopped answering .no heartbeat for 10 s"):
        trainer.check()
    beats_for(1)  # beating again: alive
    generator.leave("failed", "error: out of memory")  # the generator's word wins at once
    with pytest.raises(disaggregated.PeerEnded, match=r"ended before the training run did \(error"):
        trainer.check()
    # a trainer that never saw a beat counts from its first look
    late = disaggregated.Groups(1, 2, name="late", stale_s=5.0).peer("train")
    late.check()
    now[0] += 5.1
    with pytest.raises(disaggregated.PeerEnded, match="stopped answering"):
        late.check()


def test_the_generators_thread_beats_until_it_leaves(monkeypatch):
    store = _FakeStore()
    monkeypatch.setattr(disaggregated.weight_channel, "coordination_client", lambda: store)
    monkeypatch.setattr(disaggregated.Peer, "BEAT_S", 0.01)
    generator = disaggregated.Groups(1, 2).peer("generate")
    generator.start()
    key, deadline = "grpo_jax/run/run/beat/generate", time.monotonic() + 30
    while int(store.data.get(key, 0)) < 3:
        assert time.monotonic() < deadline, "no heartbeat"
        time.sleep(0.01)
    generator.leave("done")
    assert json.loads(store.data["grpo_jax/run/run/end/generate"])["status"] == "done"
    time.sleep(0.1)
    last = store.data[key]
    time.sleep(0.1)
    assert store.data[key] == last  # the thread stopped
