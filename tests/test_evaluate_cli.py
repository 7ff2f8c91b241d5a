"""`python -m experiments.evaluate --workdir=...`: exit 0, the result on stdout, maj@k finite,
and the same numbers as the run's own summary.json (the training run's evaluation seed)."""

import json
import math
import os
import subprocess
import sys

import pytest

from configs import arithmetic
from grpo_jax import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    cfg = arithmetic.get_config("grpo,smoke")
    cfg.steps = 2
    cfg.mesh.num_devices = 1
    cfg.logging.tensorboard = False
    workdir = str(tmp_path_factory.mktemp("smoke"))
    summary = train.train_and_evaluate(cfg, workdir)
    return workdir, summary


def _evaluate(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "experiments.evaluate", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_reevaluating_a_workdir_reproduces_its_summary(smoke_run):
    workdir, summary = smoke_run
    proc = _evaluate(f"--workdir={workdir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # the JSON result on stdout
    k = result["protocol"]["num_samples"]
    after = summary["eval_after"]
    assert result["checkpoint_step"] == summary["steps"]
    for key in ("mean_at_1", "pass_at_1", f"pass_at_{k}", f"maj_at_{k}"):
        assert math.isfinite(result["pooled"][key]), key
        assert result["pooled"][key] == pytest.approx(after[key], abs=1e-9), key
    ours, theirs = result["per_dataset"]["arithmetic"], after["per_dataset"]["arithmetic"]
    assert ours[f"maj_at_{k}"] == pytest.approx(theirs[f"maj_at_{k}"], abs=1e-9)
    assert ours["per_level"] == theirs["per_level"]
    assert os.path.isfile(os.path.join(workdir, "eval.json"))
    assert "| arithmetic |" in proc.stdout and "nan" not in proc.stdout.lower()


def test_a_missing_workdir_exits_non_zero(tmp_path):
    proc = _evaluate(f"--workdir={tmp_path / 'none'}")
    assert proc.returncode != 0
