"""Independent replication of the GDRO studies' headline numbers from their committed per-job
files (issue 46): the learning-rate choice, the relative test pass@8 gain over GRPO, its paired
bootstrap interval and the per-seed effect size, recomputed here with numpy and `math.comb` alone
(none of `experiments.compare`'s code), for one arm pair of every finished study report.

The layout read (`experiments.compare` writes it): `<report>/gdro_vs_grpo.json` (setup, sweep,
gains) and `<report>/gdro_vs_grpo/runs/<method>_lr<lr>_s<seed>.npz` whose `correct` is
`[evaluations, held-out problems, samples]` 0/1; even held-out index = validation, odd = test;
a run's score is the mean over its last `last_evals` evaluations.
"""

import glob
import json
import math
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORTS = sorted(
    os.path.dirname(p)
    for p in glob.glob(os.path.join(ROOT, "reports", "*", "gdro_vs_grpo.json"))
    if json.load(open(p)).get("finished")
)
ARM = "prompt_gdro_eta10"  # the arm every study since the lr extension carries


def _pass_at_k(correct: np.ndarray, k: int) -> np.ndarray:
    """Unbiased pass@k per problem (Chen et al. 2021, eq. 1): 1 - C(n-c, k) / C(n, k)."""
    n = correct.shape[-1]
    c = correct.sum(-1).astype(int)
    table = np.array([1.0 - math.comb(n - j, k) / math.comb(n, k) for j in range(n + 1)])
    return table[c]


def _scores(report, method, lr, seeds, half, k, last):
    """[seeds, problems of the half] pass@k, the mean of the last ``last`` evaluations."""
    out = []
    for s in seeds:
        path = os.path.join(report, "gdro_vs_grpo", "runs", f"{method}_lr{lr:g}_s{s}.npz")
        correct = np.load(path)["correct"]  # [T, N, n]
        out.append(_pass_at_k(correct[-last:, half::2], k).mean(0))
    return np.stack(out)


def _bootstrap(a, b, n_boot, rng):
    """Relative gain mean(a) / mean(b) - 1 with seeds and problems resampled independently."""
    gains = np.empty(n_boot)
    for i in range(n_boot):
        si = rng.integers(0, a.shape[0], a.shape[0])
        pi = rng.integers(0, a.shape[1], a.shape[1])
        gains[i] = a[np.ix_(si, pi)].mean() / b[np.ix_(si, pi)].mean() - 1
    return gains


@pytest.mark.skipif(not REPORTS, reason="no finished GDRO study report is committed")
@pytest.mark.parametrize("report", REPORTS, ids=[os.path.basename(r) for r in REPORTS])
def test_one_arm_pair_replicates_from_the_per_job_files(report):
    rep = json.load(open(os.path.join(report, "gdro_vs_grpo.json")))
    setup = rep["setup"]
    if ARM not in setup["methods"]:
        pytest.skip(f"{os.path.basename(report)} has no {ARM} arm")
    k, last = rep["pass_k"], setup["last_evals"]

    # the learning rate: the best mean validation pass@k over the sweep seeds
    chosen = {}
    for m in ("grpo", ARM):
        val = {
            lr: _scores(report, m, lr, setup["sweep_seeds"], 0, k, last).mean()
            for lr in setup["lrs"]
        }
        chosen[m] = max(val, key=val.get)
        assert chosen[m] == rep["sweep"][m]["chosen"], (m, val)

    # the headline: relative test pass@k gain over GRPO on every final seed
    a = _scores(report, ARM, chosen[ARM], setup["seeds"], 1, k, last)
    b = _scores(report, "grpo", chosen["grpo"], setup["seeds"], 1, k, last)
    assert a.shape == (len(setup["seeds"]), setup["num_test"])
    got = rep["gains"][ARM]["pass_at_k"]
    np.testing.assert_allclose(a.mean() / b.mean() - 1, got["gain"], rtol=1e-9)
    np.testing.assert_allclose(a.mean(), got["mean"], rtol=1e-12)
    np.testing.assert_allclose(b.mean(), got["base"], rtol=1e-12)
    d = a.mean(1) - b.mean(1)
    np.testing.assert_allclose(d.mean() / d.std(ddof=1), got["d_z"], rtol=1e-9)

    # its 95% interval, from a bootstrap of our own: equal to Monte Carlo error
    gains = _bootstrap(a, b, 4000, np.random.default_rng(46))
    lo, hi = np.percentile(gains, [2.5, 97.5])
    tol = 0.15 * (got["hi"] - got["lo"])  # the two bootstraps' percentile noise, both sides
    assert abs(lo - got["lo"]) < tol and abs(hi - got["hi"]) < tol, (lo, hi, got)
    assert (lo > 0) == (got["lo"] > 0)  # the same verdict
