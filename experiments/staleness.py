"""One-step-off rollouts against the synchronous step, paired by seed (issue 47).

`python -m experiments.staleness --out=reports/staleness --seeds=8`

For each seed, two runs of the arithmetic default (`configs/arithmetic.py:grpo`, its warm start
and 100 GRPO steps): `rollout.max_staleness=0` (today's synchronous step) and
`rollout.max_staleness=1` with truncated importance sampling (`algorithm.tis_cap=2`, the
README's setting). Each run is `python -m experiments.run` in its own workdir under `--runs`;
a seed whose two `summary.json` exist is not rerun (rerun the command to resume). The report
(`--out/staleness.{md,json}`) holds every run's held-out figures, so it rebuilds without them.

Criterion, fixed before the runs: k = 1 is "within noise" of k = 0 when the 95% paired
t-interval of held-out mean@1 (k = 1 minus k = 0, over seeds) contains 0. The report also gives
the seed-to-seed standard deviation of k = 0 (the noise a single pair is read against) and the
same figures for pass@8.
"""

import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
from absl import flags
from scipy import stats

from grpo_jax import cli

_OUT = flags.DEFINE_string("out", "reports/staleness", "output directory")
_SEEDS = flags.DEFINE_string("seeds", "8", "N (= seeds 0..N-1) or a list '3,5'")
_CONFIG = flags.DEFINE_string("config", "configs/arithmetic.py:grpo", "config of both arms")
_RUNS = flags.DEFINE_string(
    "runs", "workdirs/staleness", "the runs' workdirs (checkpoints: not committed)"
)
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "rebuild the report from the runs")

ARMS = {
    "k0": [],
    "k1": ["--config.rollout.max_staleness=1", "--config.algorithm.tis_cap=2"],
}
METRICS = ("mean_at_1", "pass_at_8")


def _seeds(text):
    """--seeds: N (seeds 0 .. N-1) or a list "3,5"; raises UsageError naming the flag."""
    try:
        seeds = [int(s) for s in text.split(",") if s] if "," in text else list(range(int(text)))
    except ValueError:
        raise cli.UsageError(f"--seeds={text}: give N or a list like 3,5") from None
    if not seeds or min(seeds) < 0:
        raise cli.UsageError(f"--seeds={text}: give at least one seed, none negative")
    return seeds


def _check_config(spec):
    """--config: the file must exist (before any run starts); raises UsageError."""
    path = spec.split(":", 1)[0]
    if not os.path.isfile(path):
        raise cli.UsageError(f"--config={spec}: no file {path}")


def _run(arm, seed):
    """Runs one arm at one seed unless its summary exists; returns its summary.json."""
    workdir = os.path.join(_RUNS.value, f"{arm}_seed{seed}")
    summary = os.path.join(workdir, "summary.json")
    if not os.path.exists(summary):
        cmd = [
            sys.executable,
            "-m",
            "experiments.run",
            f"--config={_CONFIG.value}",
            f"--workdir={workdir}",
            f"--config.seed={seed}",
            *ARMS[arm],
        ]
        start = time.time()
        code = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
        if code:  # its own error line or traceback is above; its workdir resumes on a rerun
            raise SystemExit(f"error: {arm} seed {seed}: experiments.run exited {code} ({workdir})")
        print(f"{arm} seed {seed}: {time.time() - start:.0f} s", flush=True)
    with open(summary) as f:
        return json.load(f)


def _figures(summary):
    """The report's figures of one run: held-out after (METRICS), mean@1 before, wall seconds."""
    out = {m: summary["eval_after"][m] for m in METRICS}
    out["mean_at_1_before"] = summary["eval_before"]["mean_at_1"]
    out["wall_seconds"] = summary["wall_seconds"]
    return out


def _machine():
    """One line: CPU model, cores, Python, jax, the commit the report was built at."""
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, jax {jax.__version__}"
        f", report built at {head.stdout.strip() or 'unknown commit'}"
    )


def _interval(diffs):
    n = len(diffs)
    mean = float(np.mean(diffs))
    if n < 2:
        return mean, float("nan"), float("nan")
    half = stats.t.ppf(0.975, n - 1) * float(np.std(diffs, ddof=1)) / np.sqrt(n)
    return mean, mean - half, mean + half


def report(out, rows):
    """Writes `out/staleness.json` and `out/staleness.md` from {seed: {arm: eval_after}}."""
    seeds = sorted(rows)
    lines = [
        "# One-step-off rollouts (k = 1) against the synchronous step (k = 0)",
        "",
        f"`python -m experiments.staleness --out={out} --seeds={','.join(map(str, seeds))}`: "
        f"`{_CONFIG.value}` (its warm start, then GRPO), held-out problems as the README's "
        "table; k = 1 adds `--config.rollout.max_staleness=1 --config.algorithm.tis_cap=2`.",
        "Criterion (fixed before the runs): within noise when the 95% paired t-interval of "
        "k = 1 minus k = 0 contains 0.",
        f"Machine: {_machine()}.",
        "",
        "| seed | mean@1 before | mean@1 k = 0 | mean@1 k = 1 | difference "
        "| pass@8 k = 0 | pass@8 k = 1 | difference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary = {"seeds": seeds, "runs": {str(s): rows[s] for s in seeds}}
    for s in seeds:
        cells = [f"{rows[s]['k0']['mean_at_1_before']:.4f}"]
        for m in METRICS:
            a, b = rows[s]["k0"][m], rows[s]["k1"][m]
            cells += [f"{a:.4f}", f"{b:.4f}", f"{b - a:+.4f}"]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines.append("")
    for m in METRICS:
        k0 = np.array([rows[s]["k0"][m] for s in seeds])
        diffs = np.array([rows[s]["k1"][m] - rows[s]["k0"][m] for s in seeds])
        mean, low, high = _interval(diffs)
        within = bool(low <= 0.0 <= high)
        sd = float(np.std(k0, ddof=1)) if len(k0) > 1 else float("nan")
        summary[m] = {
            "mean_difference": mean,
            "ci95": [low, high],
            "within_noise": within,
            "k0_mean": float(k0.mean()),
            "k0_seed_sd": sd,
        }
        lines.append(
            f"- **{m}**: k = 0 {k0.mean():.4f} (seed-to-seed sd {sd:.4f}); k = 1 minus k = 0 "
            f"{mean:+.4f}, 95% paired t-interval [{low:+.4f}, {high:+.4f}] over {len(seeds)} "
            f"seeds: {'within noise' if within else 'NOT within noise'}."
        )
    walls = {a: [rows[s][a]["wall_seconds"] for s in seeds] for a in ARMS}
    summary["wall_seconds_median"] = {a: float(np.median(w)) for a, w in walls.items()}
    lines.append(
        "- Wall seconds per run (warm start, RL steps and evaluations; median over seeds; "
        "nothing to overlap on one CPU's cores, so no speed-up is expected): "
        + ", ".join(f"{a} {np.median(w):.0f}" for a, w in walls.items())
        + "."
    )
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "staleness.json"), "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
    with open(os.path.join(out, "staleness.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv):
    del argv
    out = _OUT.value
    rows = {}
    seeds = _seeds(_SEEDS.value)
    if not _REPORT_ONLY.value:
        _check_config(_CONFIG.value)
    for seed in seeds:
        if _REPORT_ONLY.value:
            paths = [os.path.join(_RUNS.value, f"{a}_seed{seed}", "summary.json") for a in ARMS]
            if not all(os.path.exists(p) for p in paths):
                continue
        rows[seed] = {arm: _run(arm, seed) for arm in ARMS}
    rows = {s: {a: _figures(r[a]) for a in r} for s, r in rows.items()}
    if not rows:
        raise cli.UsageError(f"no finished seed under {_RUNS.value}")
    report(out, rows)


if __name__ == "__main__":
    cli.run_absl(main)
