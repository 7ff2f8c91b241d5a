"""experiments.compare.by_start: gains split by the starting model's per-problem success."""

import numpy as np
import pytest

from experiments.compare import by_start


def test_gain_per_stratum_is_the_ratio_of_sums_over_its_cells():
    # seed 0: problems 0, 1 unsolved at the start, 2 solved 5 times; seed 1: problem 0 solved twice
    start = np.array([[0, 0, 5], [2, 0, 12]])
    base = np.array([[0.2, 0.1, 0.6], [0.5, 0.3, 0.9]])
    method = np.array([[0.3, 0.2, 0.6], [0.4, 0.3, 0.99]])
    rows = by_start.gains_by_start(method, base, start, n_boot=200)
    by = {(r["lo_count"], r["hi_count"]): r for r in rows}
    # stratum 0: cells (0,0), (0,1), (1,1): (0.3 + 0.2 + 0.3) / (0.2 + 0.1 + 0.3) - 1 = 1/3
    assert by[(0, 0)]["gain"] == pytest.approx(0.8 / 0.6 - 1)
    assert by[(0, 0)]["share"] == pytest.approx(3 / 6)
    assert by[(0, 0)]["base"] == pytest.approx(0.6 / 3)
    assert by[(1, 2)]["gain"] == pytest.approx(0.4 / 0.5 - 1)
    assert by[(3, 9)]["gain"] == pytest.approx(0.0)
    assert by[(10, None)]["gain"] == pytest.approx(0.99 / 0.9 - 1)


def test_a_constant_ratio_gives_a_zero_width_interval_and_an_empty_stratum_nan():
    rng = np.random.default_rng(1)
    base = rng.uniform(0.1, 1.0, size=(5, 40))
    start = rng.integers(0, 3, size=(5, 40))  # nothing reaches 3+
    rows = by_start.gains_by_start(1.25 * base, base, start, strata=((0, 2), (3, None)))
    assert rows[0]["gain"] == pytest.approx(0.25)
    assert rows[0]["lo"] == pytest.approx(0.25) and rows[0]["hi"] == pytest.approx(0.25)
    assert np.isnan(rows[1]["gain"]) and rows[1]["share"] == 0.0


def test_the_interval_is_paired_and_covers_the_estimate():
    rng = np.random.default_rng(2)
    base = rng.uniform(0.1, 0.9, size=(8, 100))
    method = np.clip(base + rng.normal(0.02, 0.05, size=base.shape), 0, 1)
    start = rng.integers(0, 32, size=base.shape)
    (row,) = by_start.gains_by_start(method, base, start, strata=((0, None),))
    assert row["lo"] < row["gain"] < row["hi"]


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
