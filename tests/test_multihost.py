"""Two processes x 4 virtual CPU devices, joined by the JAX distributed runtime (gloo collectives).

`python -m experiments.run` is launched twice per phase on localhost, once with the
`--coordinator_address/--num_processes/--process_id` flags and once with the GRPO_JAX_*
environment variables. Every process draws the same global batch and supplies the shards its
devices own; Orbax saves and restores across both. The run (stopped by a SIGTERM to one process,
then a restart of both that resumes from the checkpoint to step 3) must match one process
driving the same 8-device mesh straight through 3 steps.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from processes import finish, free_port, wait_for_training_row

from configs import arithmetic
from grpo_jax import train, writers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The smoke config with evaluation sampling identical to the training sampler (same rows, same
# SamplingConfig: one compiled generate). A short warm start teaches the answer format and a
# format bonus then gives the rollouts of a group different rewards, so the losses are not zero.
OVERRIDES = {
    "mesh.data": 8,
    "logging.tensorboard": False,
    "sft.steps": 30,
    "sft.learning_rate": 3e-3,
    "sft.batch_size": 32,
    "reward.format_reward": 0.5,
    "eval.max_examples": 4,
    "eval.batch_size": 32,
    "eval.temperature": 1.0,
    "eval.top_k": 0,
    "eval.top_p": 1.0,
    "checkpoint.every_steps": 1,
}
COMPARED = (
    "loss",
    "grad_norm",
    "clip_fraction",
    "approx_kl",
    "reward_mean",
    "pass_rate",
    "completion_length",
    "generated_tokens",
    "bin_counts",
    "advantage_abs_mean",
)


def _run_pair(workdir, steps, *, use_env: bool, timeout=600):
    """Runs both processes to completion; returns their (returncode, output) pairs."""
    return finish(_start_pair(workdir, steps, use_env=use_env), timeout)


def _start_pair(workdir, steps, *, use_env: bool) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for pid in range(2):
        # a persistent compilation cache shared by both phases: the restart reuses the executables
        env = {
            **os.environ,
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4 "
            + os.environ.get("GRPO_JAX_TEST_COMPILE_FLAGS", ""),
            "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": os.path.join(os.path.dirname(workdir), "jax_cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }
        args = [
            sys.executable,
            "-m",
            "experiments.run",
            "--config=configs/arithmetic.py:grpo,smoke",
            f"--workdir={workdir}",
            f"--config.steps={steps}",
            "--distributed_timeout_s=120",
        ]
        args += [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
        if use_env:
            env.update(
                GRPO_JAX_COORDINATOR=f"localhost:{port}",
                GRPO_JAX_NUM_PROCESSES="2",
                GRPO_JAX_PROCESS_ID=str(pid),
            )
        else:
            args += [
                f"--coordinator_address=localhost:{port}",
                "--num_processes=2",
                f"--process_id={pid}",
            ]
        procs.append(
            subprocess.Popen(
                args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return procs


def _rows(workdir):
    return [r for r in writers.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "loss" in r]


@pytest.mark.slow
def test_two_processes_stopped_by_a_signal_to_one_resume_and_match_one_process(tmp_path):
    # a SIGTERM to process 1 alone (a preemption notice to one host) stops both at the same
    # step: the signal is agreed at the step's end (Preemption.agree), both checkpoint and exit
    # 0 (was: process 1 stopped to save while process 0 went on into the next step's
    # collectives, and both hung). Both rerun: resume there and match one process throughout.
    multi = str(tmp_path / "multi")
    procs = _start_pair(multi, 3, use_env=False)
    wait_for_training_row(multi, 1, procs, timeout=400)
    procs[1].send_signal(signal.SIGTERM)
    first = finish(procs, 400)
    for rc, out in first:
        assert rc == 0, out[-3000:]
    for i, (_, out) in enumerate(first):
        assert f"process {i}/2" in out and "4 local / 8 global devices" in out
    # process 0, which got no signal, reports the stop
    stop = int(re.search(r"SIGTERM: checkpoint written at step (\d+); exiting", first[0][1])[1])
    assert 1 <= stop < 3, first[0][1][-3000:]
    assert sorted(os.listdir(os.path.join(multi, "checkpoints")))[-1] == str(stop)

    second = _run_pair(multi, 3, use_env=True)  # both restart: resume at the stop
    for rc, out in second:
        assert rc == 0, out[-3000:]
        assert f"Resuming from checkpoint at step {stop}" in out
    assert sum("algorithm=grpo steps=3" in out for _, out in second) == 1  # process 0 reports

    cfg = arithmetic.get_config("grpo,smoke")
    cfg.steps = 3
    for key, value in OVERRIDES.items():
        section, field = key.split(".")
        cfg[section][field] = value
    single = str(tmp_path / "single")
    train.train_and_evaluate(cfg, single)  # one process, the same 8-device mesh

    a, b = _rows(single), _rows(multi)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]  # no duplicate rows
    assert any(r["loss"] != 0 for r in a)  # a test that can fail
    for ra, rb in zip(a, b):
        for key in COMPARED:
            np.testing.assert_allclose(
                ra[key], rb[key], rtol=1e-5, atol=1e-6, err_msg=f"step {ra['step']}: {key}"
            )
    summaries = [json.load(open(os.path.join(d, "summary.json"))) for d in (single, multi)]
    assert summaries[0]["eval_after"]["mean_at_1"] == summaries[1]["eval_after"]["mean_at_1"]


def test_a_job_that_never_forms_ends_on_a_signal_or_at_the_join_timeout_with_one_line(tmp_path):
    # process 0 of 2 alone: JAX's join is one blocking call; a SIGTERM during it is acted on at
    # once, and a job that does not form ends at --distributed_timeout_s with one error line
    # (was: the signal ignored, then JAX's abort with a stack dump at its deadline)
    def start(timeout_s):
        args = [
            sys.executable,
            "-m",
            "experiments.run",
            "--config=configs/arithmetic.py:grpo,smoke",
        ]
        args += [f"--workdir={tmp_path / 'w'}", f"--coordinator_address=localhost:{free_port()}"]
        args += ["--num_processes=2", "--process_id=0", f"--distributed_timeout_s={timeout_s}"]
        # a two-group trainer: its coordination service logs a line as the join starts
        args += ["--role=train", "--config.rollout.max_staleness=1", "--config.mesh.num_devices=1"]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        return subprocess.Popen(
            args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    alone = start(120)
    seen = ""
    while "recoverable task" not in seen:  # in the join
        seen += alone.stdout.readline()
        assert alone.poll() is None, seen
    alone.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    ((rc, out),) = finish([alone], timeout=60)
    out = seen + out
    assert rc == 0 and time.monotonic() - t0 < 30, out[-3000:]
    assert "SIGTERM before the run started: nothing saved" in out

    t0 = time.monotonic()
    ((rc, out),) = finish([start(8)], timeout=120)
    assert rc == 1 and time.monotonic() - t0 < 60, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: not every one of 2 processes joined the job within --distributed_timeout_s=8 s "
        "(one not started, or stopped while joining); nothing was run"
    ], out[-3000:]
    assert "stack trace" not in out and "Traceback" not in out
    assert not os.path.exists(tmp_path / "w")  # nothing written


# ----------------------------------------------------------------------------- flags and scripts


def test_initialize_distributed_argument_checks(monkeypatch):
    from grpo_jax import distributed as run

    for var in (
        "GRPO_JAX_COORDINATOR",
        "GRPO_JAX_NUM_PROCESSES",
        "GRPO_JAX_PROCESS_ID",
        "TPU_WORKER_HOSTNAMES",
        "SLURM_JOB_ID",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_SIZE",
    ):
        monkeypatch.delenv(var, raising=False)
    assert run.initialize("auto") is False  # one process: nothing to join
    assert run.initialize("off", "localhost:1", 2, 0) is False
    with pytest.raises(ValueError, match="--num_processes and --process_id"):
        run.initialize("auto", "localhost:1234")
    monkeypatch.setenv("GRPO_JAX_COORDINATOR", "localhost:1234")
    monkeypatch.setenv("GRPO_JAX_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="--process_id"):  # the environment counts too
        run.initialize("auto")
    monkeypatch.delenv("GRPO_JAX_COORDINATOR")
    with pytest.raises(ValueError, match="need --coordinator_address"):
        run.initialize("auto")
    monkeypatch.delenv("GRPO_JAX_NUM_PROCESSES")
    assert run._detected_cluster() is None
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1k-w-0,t1k-w-1")
    assert run._detected_cluster() == "TPU pod"
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")  # a single-host TPU VM
    assert run._detected_cluster() is None
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert run._detected_cluster() == "Slurm"


def _script(name, *args):
    return subprocess.run(
        ["bash", os.path.join(REPO, "scripts", name), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_tpu_pod_script_dry_run_prints_create_install_run_and_delete(tmp_path):
    out = _script(
        "launch_tpu_pod.sh",
        "--dry-run",
        "--name=t1",
        "--zone=us-east5-a",
        "--type=v5p-64",
        "--workdir=/mnt/gcs/runs/a",
        "--gcs-bucket=b",
        "--",
        "--config=configs/dapo_qwen3.py:8b,grpo",
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(
        "gcloud compute tpus tpu-vm create t1 --zone=us-east5-a "
        "--accelerator-type=v5p-64 --version=v2-alpha-tpuv5"
    )
    run_line = next(l for l in lines if "experiments.run" in l)
    assert "--worker=all" in run_line and "--distributed=on" in run_line
    assert (
        "--workdir=/mnt/gcs/runs/a" in run_line
        and "JAX_COMPILATION_CACHE_DIR=/mnt/gcs/runs/jax_cache" in run_line
    )
    assert lines[-1].startswith("gcloud compute tpus tpu-vm delete t1")
    assert not os.path.exists(os.path.join(REPO, "logs", "t1"))  # a dry run creates nothing
    bad = _script("launch_tpu_pod.sh", "--dry-run", "--name=t1", "--zone=z", "--workdir=w")
    assert bad.returncode == 2 and "experiments.run flags after --" in bad.stderr


def test_slurm_script_dry_run_prints_the_batch_script_and_srun():
    out = _script(
        "launch_gpu_slurm.sh",
        "--dry-run",
        "--nodes=2",
        "--partition=gpu",
        "--workdir=/shared/runs/a",
        "--",
        "--config=configs/dapo_qwen3.py:8b,grpo,gpu8",
    )
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --nodes=2" in out.stdout and "#SBATCH --partition=gpu" in out.stdout
    srun = next(l for l in out.stdout.splitlines() if l.startswith("srun "))
    assert "--ntasks-per-node=1" in srun and "--kill-on-bad-exit=1" in srun
    assert "--num_processes=$SLURM_NTASKS --process_id=$SLURM_PROCID" in out.stdout
    assert "--coordinator_address=$GRPO_HEAD:$GRPO_PORT" in out.stdout


@pytest.mark.skipif(not shutil.which("shellcheck"), reason="shellcheck not installed")
def test_launch_scripts_pass_shellcheck():
    out = subprocess.run(
        ["shellcheck", "scripts/launch_tpu_pod.sh", "scripts/launch_gpu_slurm.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout
