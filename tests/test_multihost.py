"""Two processes x 4 virtual CPU devices, joined by the JAX distributed runtime (gloo collectives).

`python -m experiments.run` is launched twice per phase on localhost, once with the
`--coordinator_address/--num_processes/--process_id` flags and once with the GRPO_JAX_*
environment variables. Every process draws the same global batch and supplies the shards its
devices own; Orbax saves and restores across both. The run (2 steps, then a restart of both
processes with steps=3 that resumes from the checkpoint) must match one process driving the same
8-device mesh straight through 3 steps.
"""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from configs import arithmetic
from grpo_jax import train
from grpo_jax import writers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The smoke config, made cheap to compile: no warm start, and evaluation sampling identical to
# the training sampler (same rows, same SamplingConfig: one compiled generate). A format bonus
# gives the untrained model's rollouts different rewards, so the losses are not all zero.
OVERRIDES = {
    "mesh.data": 8, "logging.tensorboard": False, "sft.steps": 0, "reward.format_reward": 0.5,
    "eval.max_examples": 4, "eval.batch_size": 32, "eval.temperature": 1.0, "eval.top_k": 0,
    "eval.top_p": 1.0, "checkpoint.every_steps": 1,
}
COMPARED = ("loss", "grad_norm", "clip_fraction", "approx_kl", "reward_mean", "pass_rate",
            "completion_length", "generated_tokens", "bin_counts", "advantage_abs_mean")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _run_pair(workdir, steps, *, use_env: bool, timeout=600):
  """Runs both processes to completion; returns their (returncode, output) pairs."""
  port = _free_port()
  procs = []
  for pid in range(2):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}
    args = [sys.executable, "-m", "experiments.run", "--config=configs/arithmetic.py:grpo,smoke",
            f"--workdir={workdir}", f"--config.steps={steps}", "--distributed_timeout_s=120"]
    args += [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
    if use_env:
      env.update(GRPO_JAX_COORDINATOR=f"localhost:{port}", GRPO_JAX_NUM_PROCESSES="2",
                 GRPO_JAX_PROCESS_ID=str(pid))
    else:
      args += [f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={pid}"]
    procs.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  outs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=timeout)
      outs.append((p.returncode, out))
  finally:
    for p in procs:  # one process failing leaves the other waiting in a collective
      if p.poll() is None:
        p.kill()
        p.communicate()
  return outs


def _rows(workdir):
  return [r for r in writers.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "loss" in r]


@pytest.mark.slow
def test_two_processes_train_save_restart_and_match_one_process(tmp_path):
  multi = str(tmp_path / "multi")
  first = _run_pair(multi, 2, use_env=False)
  for rc, out in first:
    assert rc == 0, out[-3000:]
  for i, (_, out) in enumerate(first):
    assert f"process {i}/2" in out and "4 local / 8 global devices" in out
  assert sorted(os.listdir(os.path.join(multi, "checkpoints")))[-1] == "2"

  second = _run_pair(multi, 3, use_env=True)                  # both restart: resume at step 2
  for rc, out in second:
    assert rc == 0, out[-3000:]
    assert "Resuming from checkpoint at step 2" in out
  assert sum("algorithm=grpo steps=3" in out for _, out in second) == 1   # process 0 reports

  cfg = arithmetic.get_config("grpo,smoke")
  cfg.steps = 3
  for key, value in OVERRIDES.items():
    section, field = key.split(".")
    cfg[section][field] = value
  single = str(tmp_path / "single")
  train.train_and_evaluate(cfg, single)                         # one process, the same 8-device mesh

  a, b = _rows(single), _rows(multi)
  assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]   # no duplicate rows
  assert any(r["loss"] != 0 for r in a)                          # a test that can fail
  for ra, rb in zip(a, b):
    for key in COMPARED:
      np.testing.assert_allclose(ra[key], rb[key], rtol=1e-5, atol=1e-6, err_msg=f"step {ra['step']}: {key}")
  summaries = [json.load(open(os.path.join(d, "summary.json"))) for d in (single, multi)]
  assert summaries[0]["eval_after"]["mean_at_1"] == summaries[1]["eval_after"]["mean_at_1"]
