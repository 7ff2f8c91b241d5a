"""experiments.staleness's report: the paired t-interval and verdict against hand values."""

import json
import os
import subprocess
import sys

from test_train import REPO

# seed -> arm -> (mean@1, pass@8); mean@1 differences +0.01, -0.02, +0.01 (mean 0, sd
# sqrt(3e-4)); pass@8 differences 0.10, 0.12, 0.08 (mean 0.10, sd 0.02)
_RUNS = {
    0: {"k0": (0.40, 0.50), "k1": (0.41, 0.60)},
    1: {"k0": (0.30, 0.60), "k1": (0.28, 0.72)},
    2: {"k0": (0.20, 0.70), "k1": (0.21, 0.78)},
}
_T975_DF2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom


def test_report_gives_the_paired_t_interval_and_the_verdict_by_hand(tmp_path):
    for seed, arms in _RUNS.items():
        for arm, (mean1, pass8) in arms.items():
            workdir = tmp_path / "runs" / f"{arm}_seed{seed}"
            workdir.mkdir(parents=True)
            summary = {
                "eval_before": {"mean_at_1": 0.1},
                "eval_after": {"mean_at_1": mean1, "pass_at_8": pass8},
                "wall_seconds": 100.0 + seed,
            }
            (workdir / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.staleness", "--report_only", "--seeds=4"]
        + [f"--runs={tmp_path / 'runs'}", f"--out={out}"],  # seed 3 has no runs: left out
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((out / "staleness.json").read_text())
    assert got["seeds"] == [0, 1, 2]
    half = _T975_DF2 * 3e-4**0.5 / 3**0.5
    m1 = got["mean_at_1"]
    assert abs(m1["mean_difference"]) < 1e-12
    assert abs(m1["ci95"][0] + half) < 1e-9 and abs(m1["ci95"][1] - half) < 1e-9
    assert m1["within_noise"] is True
    assert abs(m1["k0_seed_sd"] - 0.1) < 1e-12
    half = _T975_DF2 * 0.02 / 3**0.5
    p8 = got["pass_at_8"]
    assert abs(p8["mean_difference"] - 0.10) < 1e-12
    assert abs(p8["ci95"][0] - (0.10 - half)) < 1e-9 and abs(p8["ci95"][1] - (0.10 + half)) < 1e-9
    assert p8["within_noise"] is False  # the interval [0.050, 0.150] excludes 0
    assert got["wall_seconds_median"] == {"k0": 101.0, "k1": 101.0}
    md = (out / "staleness.md").read_text()
    assert "| 1 | 0.1000 | 0.3000 | 0.2800 | -0.0200 | 0.6000 | 0.7200 | +0.1200 |" in md
    assert "pass_at_8**" in md and "NOT within noise" in md
