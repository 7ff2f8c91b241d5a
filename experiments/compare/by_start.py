"""Where a method's gain sits, for a finished comparison's job files: relative test pass@k gains
over a baseline by each seed's warm-start success on each problem (`statistics.gains_by_start`;
a new comparison's report has the same section).

    python -m experiments.compare.by_start --runs=reports/gdro_lr_extension/gdro_vs_grpo/runs \
      --method=prompt_gdro_eta10_lr3e-06 --base=grpo_lr3e-06 --seeds=20

reads ``<runs>/<method>_s<seed>.npz`` and ``<base>_s<seed>.npz`` (``correct [T, N, n]``, the T
evaluations' per-sample correctness on the held-out list) and ``warm_s<seed>.npz`` (``correct
[N, m]``, the seed's warm start's) and prints one row per stratum.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from experiments.compare.plan import PASS_K, split_heldout
from experiments.compare.statistics import START_LABELS, gains_by_start, per_problem_scores
from grpo_jax import cli


def _correct(path: Path) -> np.ndarray:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such job file")
    return np.load(path)["correct"]


def load(runs: Path, name: str, seeds: Sequence[int], last: int, pass_k: int) -> np.ndarray:
    """Test-half per-problem pass@k ``[S, N_test]`` of ``<runs>/<name>_s<seed>.npz``, the mean of
    the last ``last`` evaluations. Raises FileNotFoundError naming a missing file."""
    c = np.stack([_correct(runs / f"{name}_s{s}.npz") for s in seeds])  # [S, T, N, n]
    _, test = split_heldout(c.shape[2])
    return per_problem_scores(c[:, :, test], "pass_at_k", last=last, pass_k=pass_k)


def start_rates(runs: Path, seeds: Sequence[int]) -> np.ndarray:
    """Each seed's warm start's share of correct samples on the test half, ``[S, N_test]``."""
    c = np.stack([_correct(runs / f"warm_s{s}.npz") for s in seeds])  # [S, N, m]
    return c[:, split_heldout(c.shape[1])[1]].mean(-1)


def table(by: dict, k: int) -> str:
    """Markdown table of `statistics.gains_by_start`'s result."""
    out = [
        f"| warm start's success on the problem | share of cells | base pass@{k} | "
        f"method pass@{k} | relative gain [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for lab in START_LABELS:
        r = by[lab]
        if r is None:
            out.append(f"| {lab} | 0% | — | — | — |")
            continue
        out.append(
            f"| {lab} | {by['share'][lab]:.0%} | {100 * r['base']:.1f} | {100 * r['method']:.1f} "
            f"| {100 * r['gain']:+.1f}% [{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}] |"
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
    by = gains_by_start(a, b, start_rates(runs, seeds))
    print(f"{args.method} vs {args.base}, test half, seeds 0-{args.seeds - 1}:")
    print(table(by, args.pass_k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
