"""Gains by the starting model's per-problem success: `statistics.gains_by_start` and the
`experiments.compare.by_start` reader of finished job files."""

import numpy as np
import pytest

from experiments.compare import by_start
from experiments.compare.statistics import gains_by_start


def test_gain_per_stratum_is_the_ratio_of_sums_over_its_cells():
    # seed 0: problems 0, 1 never solved at the start, 2 solved 5 of 32; seed 1: problem 0 2 of 32
    rate = np.array([[0, 0, 5], [2, 0, 12]]) / 32
    base = np.array([[0.2, 0.1, 0.6], [0.5, 0.3, 0.9]])
    method = np.array([[0.3, 0.2, 0.6], [0.4, 0.3, 0.99]])
    by = gains_by_start(method, base, rate, n_boot=200)
    # stratum 0: cells (0,0), (0,1), (1,1): (0.3 + 0.2 + 0.3) / (0.2 + 0.1 + 0.3) - 1
    assert by["0"]["gain"] == pytest.approx(0.8 / 0.6 - 1)
    assert by["share"]["0"] == pytest.approx(3 / 6)
    assert by["0"]["base"] == pytest.approx(0.6 / 3)
    assert by["(0, 0.1]"]["gain"] == pytest.approx(0.4 / 0.5 - 1)  # 2/32
    assert by["(0.1, 0.3]"]["gain"] == pytest.approx(0.0)  # 5/32
    assert by["> 0.3"]["gain"] == pytest.approx(0.99 / 0.9 - 1)  # 12/32


def test_a_constant_ratio_gives_a_zero_width_interval_and_an_empty_stratum_none():
    rng = np.random.default_rng(1)
    base = rng.uniform(0.1, 1.0, size=(5, 40))
    rate = rng.choice([0.0, 0.05], size=(5, 40))  # nothing above 0.1
    by = gains_by_start(1.25 * base, base, rate)
    for lab in ("0", "(0, 0.1]"):
        assert by[lab]["gain"] == pytest.approx(0.25)
        assert by[lab]["lo"] == pytest.approx(0.25) and by[lab]["hi"] == pytest.approx(0.25)
    assert by["> 0.3"] is None and by["share"]["> 0.3"] == 0.0


def test_the_interval_is_paired_and_covers_the_estimate():
    rng = np.random.default_rng(2)
    base = rng.uniform(0.1, 0.9, size=(8, 100))
    method = np.clip(base + rng.normal(0.02, 0.05, size=base.shape), 0, 1)
    by = gains_by_start(method, base, np.full(base.shape, 0.5))
    assert by["> 0.3"]["lo"] < by["> 0.3"]["gain"] < by["> 0.3"]["hi"]


def test_cli_reads_job_files_and_names_a_missing_one(tmp_path, capsys):
    rng = np.random.default_rng(3)
    for s in range(2):
        np.savez(tmp_path / f"warm_s{s}.npz", correct=rng.random((6, 4)) < 0.3)
        for name in ("a", "b"):
            np.savez(tmp_path / f"{name}_s{s}.npz", correct=rng.random((2, 6, 4)) < 0.5)
    assert by_start.main([f"--runs={tmp_path}", "--method=a", "--base=b", "--seeds=2"]) == 0
    assert "relative gain" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        by_start.main([f"--runs={tmp_path}", "--method=a", "--base=b", "--seeds=3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "a_s2.npz" in err[0]
