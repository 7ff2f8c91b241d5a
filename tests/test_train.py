"""End-to-end tests of the training loop on the embedded default at smoke size."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from configs import arithmetic
from grpo_jax import config_utils
from grpo_jax import train
from grpo_jax import writers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Fields that measure time (or depend on it) differ between runs; everything else must match.
_TIMING = ("time/", "tokens_per_s/", "reward/seconds")


def smoke_config(algorithm="grpo", **overrides):
  c = arithmetic.get_config(f"{algorithm},smoke")
  c.mesh.num_devices = 1
  c.logging.tensorboard = False
  for key, value in overrides.items():
    node = c
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  return c


def deterministic_rows(workdir):
  rows = writers.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  return [{k: v for k, v in r.items() if not k.startswith(_TIMING)} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "prompt_gdro", "rollout_gdro", "ppo"])
def test_smoke_run_writes_summary_metrics_and_checkpoints(tmp_path, algorithm):
  summary = train.train_and_evaluate(smoke_config(algorithm), str(tmp_path))
  assert summary["algorithm"] == algorithm and summary["steps"] == 3
  for phase in ("eval_before", "eval_after"):
    assert {"mean_at_1", "pass_at_8"} <= set(summary[phase])
  on_disk = json.load(open(tmp_path / "summary.json"))
  assert on_disk["steps"] == 3
  rows = writers.read_jsonl(str(tmp_path / "metrics.jsonl"))
  train_rows = [r for r in rows if "reward_mean" in r]
  assert [r["step"] for r in train_rows] == [1, 2, 3]
  for r in train_rows:
    assert np.isfinite(r["loss"]) and r["skipped_updates"] == 0
    assert sum(r["bin_counts"]) == 8
  if algorithm == "rollout_gdro":
    assert all(sum(np.multiply(r["rollout_gdro/n_b"], r["gdro/bin_share"])) > 0 for r in train_rows)
  if algorithm == "ppo":
    assert all(np.isfinite(r["value_loss"]) for r in train_rows)
  assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == "3"


def _sigterm_after(workdir, step, proc_pid):
  """Sends SIGTERM to `proc_pid` once metrics.jsonl holds a row for `step`."""
  path = os.path.join(workdir, "metrics.jsonl")

  def watch():
    for _ in range(6000):
      if os.path.exists(path) and any(json.loads(l).get("step") == step and "reward_mean" in l
                                      for l in open(path) if l.strip()):
        os.kill(proc_pid, signal.SIGTERM)
        return
      time.sleep(0.05)
  t = threading.Thread(target=watch, daemon=True)
  t.start()
  return t


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "prompt_gdro", "rollout_gdro"])
def test_resume_after_sigterm_reproduces_uninterrupted_run(tmp_path, algorithm):
  cfg = smoke_config(algorithm, steps=6, **{"checkpoint.every_steps": 100})
  straight = tmp_path / "straight"
  train.train_and_evaluate(cfg, str(straight))

  interrupted = tmp_path / "interrupted"
  watcher = _sigterm_after(str(interrupted), 3, os.getpid())
  result = train.train_and_evaluate(cfg, str(interrupted))
  watcher.join(timeout=1)
  assert result.get("preempted"), result
  stopped_at = result["step"]
  assert 3 <= stopped_at < 6
  assert not os.path.exists(interrupted / "summary.json")
  train.train_and_evaluate(cfg, str(interrupted))          # resumes from the SIGTERM checkpoint

  a, b = deterministic_rows(str(straight)), deterministic_rows(str(interrupted))
  assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3, 4, 5, 6]
  assert a == b                                            # bitwise: every loss, reward, bin


@pytest.mark.slow
def test_one_device_and_eight_device_mesh_give_the_same_losses(tmp_path):
  one = smoke_config("grpo", steps=2)
  eight = smoke_config("grpo", steps=2)
  eight.mesh.num_devices, eight.mesh.data, eight.mesh.fsdp, eight.mesh.tensor = 8, 2, 2, 2
  train.train_and_evaluate(one, str(tmp_path / "one"))
  train.train_and_evaluate(eight, str(tmp_path / "eight"))
  a = [r for r in writers.read_jsonl(str(tmp_path / "one" / "metrics.jsonl")) if "loss" in r]
  b = [r for r in writers.read_jsonl(str(tmp_path / "eight" / "metrics.jsonl")) if "loss" in r]
  assert len(a) == len(b) == 2
  for ra, rb in zip(a, b):
    assert ra["reward_mean"] == rb["reward_mean"]
    np.testing.assert_allclose(ra["loss"], rb["loss"], atol=1e-5)
    np.testing.assert_allclose(ra["grad_norm"], rb["grad_norm"], rtol=1e-4, atol=1e-5)


def test_incompatible_workdir_is_refused_unless_overwrite(tmp_path):
  cfg = smoke_config("grpo")
  config_utils.check_workdir(cfg, str(tmp_path))
  other = smoke_config("grpo")
  other.optimizer.learning_rate = 0.5
  with pytest.raises(config_utils.ConfigError, match="optimizer.learning_rate"):
    config_utils.check_workdir(other, str(tmp_path))
  other.steps = 99  # resumable fields alone do not count as a different run
  cfg.steps = 99
  config_utils.check_workdir(cfg, str(tmp_path))
  other.checkpoint.overwrite = True
  config_utils.check_workdir(other, str(tmp_path))


@pytest.mark.parametrize("field,value,match", [
    ("gdro.n_min", 1, "n_min"),
    ("algorithm.name", "grpo2", "algorithm.name"),
    ("rollout.prompts_per_step", 0, "prompts_per_step"),
    ("gdro.edges", (0.5, 0.2), "edges"),
])
def test_bad_config_values_raise_one_line_errors(field, value, match):
  cfg = smoke_config("rollout_gdro", **{field: value})
  with pytest.raises(config_utils.ConfigError, match=match) as e:
    config_utils.validate(cfg)
  assert "\n" not in str(e.value)


def _run_cli(*args, timeout=120):
  return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)


def test_cli_misspelled_key_names_the_closest_valid_key(tmp_path):
  out = _run_cli("--config=configs/arithmetic.py:grpo,smoke", "--config.rollout.prompt_per_step=4",
                 f"--workdir={tmp_path}")
  assert out.returncode == 2
  assert "config.rollout.prompts_per_step" in out.stderr
  assert "Traceback" not in out.stderr


def test_mesh_that_does_not_match_the_devices_is_a_config_error(tmp_path):
  from grpo_jax.experiment import build_experiment
  cfg = smoke_config("grpo")
  cfg.mesh.num_devices, cfg.mesh.data = 1, 2
  with pytest.raises(config_utils.ConfigError, match="needs 2 devices"):
    build_experiment(cfg)
