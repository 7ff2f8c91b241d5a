"""Where a method's gain sits: relative test pass@k gains over a baseline, split by how often the
starting model (the seed's warm start) solved each problem.

    python -m experiments.compare.by_start --runs=reports/gdro_lr_extension/gdro_vs_grpo/runs \
      --method=prompt_gdro_eta10_lr3e-06 --base=grpo_lr3e-06 --seeds=20

reads ``<runs>/<method>_s<seed>.npz`` and ``<base>_s<seed>.npz`` (``correct [T, N, n]``, the T
evaluations' per-sample correctness on the held-out list) and ``warm_s<seed>.npz`` (``correct
[N, m]``, the warm start's), and prints one row per stratum of the warm start's correct count.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from experiments.compare.plan import PASS_K, split_heldout
from experiments.compare.statistics import per_problem_scores
from grpo_jax import cli

STRATA = ((0, 0), (1, 2), (3, 9), (10, None))


def gains_by_start(
    scores_m,
    scores_base,
    start_correct,
    strata: Sequence[tuple[int, int | None]] = STRATA,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> list[dict]:
    """Relative gain of a method over a baseline within strata of the starting model's success.

    The stratum of problem i in seed s is the starting model's number of correct samples
    ``start_correct[s, i]`` (each seed has its own warm start, so strata differ per seed). The
    statistic is ``sum(method) / sum(base) - 1`` over the (seed, problem) cells of the stratum.
    The interval is a paired percentile bootstrap: each replicate resamples seeds and,
    independently, problems with replacement, the same draw for both methods (as
    `statistics.paired_bootstrap`).

    Args:
      scores_m, scores_base: ``[S, N]`` float per-problem scores (e.g. test pass@8).
      start_correct: ``[S, N]`` int, the starting model's correct samples per problem.
      strata: inclusive ``(lo, hi)`` bounds of the correct count; ``hi`` None = no upper bound.
      n_boot, seed, level: bootstrap replicates, its seed, the interval's coverage.

    Returns:
      one dict per stratum: ``lo_count``, ``hi_count``, ``share`` (of all cells), ``method``,
      ``base`` (mean scores over the stratum's cells), ``gain`` with ``lo``/``hi`` (NaN when the
      stratum is empty or its baseline sums to 0).

    Raises:
      ValueError: shapes differ or are not ``[S, N]``.
    """
    a, b = np.asarray(scores_m, np.float64), np.asarray(scores_base, np.float64)
    c = np.asarray(start_correct)
    if not (a.shape == b.shape == c.shape) or a.ndim != 2:
        raise ValueError(f"need three [S, N] arrays; got {a.shape}, {b.shape}, {c.shape}")
    s, n = a.shape
    rng = np.random.default_rng(seed)
    si = rng.integers(0, s, size=(n_boot, s))
    counts = np.zeros((n_boot, n))
    np.add.at(counts, (np.arange(n_boot)[:, None], rng.integers(0, n, size=(n_boot, n))), 1.0)
    cols = np.arange(n_boot)[:, None]
    q = (1 - level) / 2
    rows = []
    for lo, hi in strata:
        mask = (c >= lo) & (c <= (np.inf if hi is None else hi))
        am, bm = a * mask, b * mask  # [S, N]: cells outside the stratum count 0
        row = {"lo_count": lo, "hi_count": hi, "share": float(mask.mean())}
        row["method"] = float(am.sum() / mask.sum()) if mask.any() else float("nan")
        row["base"] = float(bm.sum() / mask.sum()) if mask.any() else float("nan")
        num = (am @ counts.T)[si, cols].sum(1)  # [n_boot]: resampled problems, then seeds
        den = (bm @ counts.T)[si, cols].sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            reps = num / den - 1
            row["gain"] = float(am.sum() / bm.sum() - 1) if bm.sum() > 0 else float("nan")
        reps = reps[np.isfinite(reps)]
        lo_q, hi_q = np.quantile(reps, [q, 1 - q]) if reps.size else (np.nan, np.nan)
        row["lo"], row["hi"] = float(lo_q), float(hi_q)
        rows.append(row)
    return rows


def load(runs: Path, name: str, seeds: Sequence[int], last: int, pass_k: int) -> np.ndarray:
    """Test-half per-problem pass@k ``[S, N_test]`` of ``<runs>/<name>_s<seed>.npz``, the mean of
    the last ``last`` evaluations. Raises FileNotFoundError naming a missing file."""
    correct = []
    for s in seeds:
        path = runs / f"{name}_s{s}.npz"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such job file")
        correct.append(np.load(path)["correct"])
    c = np.stack(correct)  # [S, T, N, n]
    _, test = split_heldout(c.shape[2])
    return per_problem_scores(c[:, :, test], "pass_at_k", last=last, pass_k=pass_k)


def start_counts(runs: Path, seeds: Sequence[int]) -> np.ndarray:
    """The warm starts' correct counts on the test half, ``[S, N_test]`` int."""
    out = []
    for s in seeds:
        path = runs / f"warm_s{s}.npz"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such warm-start file")
        c = np.load(path)["correct"]
        out.append(c[split_heldout(c.shape[0])[1]].sum(-1))
    return np.stack(out)


def table(rows: list[dict], k: int) -> str:
    """Markdown table of `gains_by_start`'s rows."""
    out = [
        f"| starting model's correct samples | share of cells | base pass@{k} | method pass@{k} "
        f"| relative gain [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        span = (
            f">= {r['lo_count']}" if r["hi_count"] is None else f"{r['lo_count']}-{r['hi_count']}"
        )
        if r["hi_count"] == r["lo_count"]:
            span = str(r["lo_count"])
        out.append(
            f"| {span} | {r['share']:.0%} | {100 * r['base']:.1f} | {100 * r['method']:.1f} | "
            f"{100 * r['gain']:+.1f}% [{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}] |"
        )
    return "\n".join(out)


@cli.entry_point
def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", required=True, help="a comparison's runs/ folder")
    p.add_argument(
        "--method", required=True, help="job name prefix, e.g. prompt_gdro_eta10_lr3e-06"
    )
    p.add_argument("--base", required=True, help="baseline job name prefix, e.g. grpo_lr3e-06")
    p.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1")
    p.add_argument("--last", type=int, default=3, help="average the last N evaluations")
    p.add_argument("--pass_k", type=int, default=PASS_K)
    args = p.parse_args(argv)
    runs, seeds = Path(args.runs), range(args.seeds)
    a = load(runs, args.method, seeds, args.last, args.pass_k)  # a missing file: one error line
    b = load(runs, args.base, seeds, args.last, args.pass_k)
    c = start_counts(runs, seeds)
    print(f"{args.method} vs {args.base}, test half, seeds 0-{args.seeds - 1}:")
    print(table(gains_by_start(a, b, c), args.pass_k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
