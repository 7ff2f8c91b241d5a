"""The CPU RL step of this tree against another commit's, measured in one run (A/B).

  python benchmarks/bench_step_ab.py --ref=14269bf^1 --rounds=3 --json_out=ab.json

Each round runs `benchmarks/bench_step.py` (same config, its warm-up steps excluded) once in
this tree and once in a temporary `git worktree` of ``--ref`` (fresh processes, alternating
which goes first), so both see the same machine state; the report is every round's median
per-phase seconds and, per tree, the median over rounds of the step's total (``time/step``,
the loop's sum of its ``time/*`` phases). Nothing else should run on the machine meanwhile.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import bench_step  # noqa: E402


def _bench(tree: str, args, out: str) -> dict:
    cmd = [sys.executable, "benchmarks/bench_step.py", f"--config={args.config}"]
    cmd += [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--json_out={out}"]
    cmd += [f"--set={s}" for s in args.set]
    env = dict(os.environ, PYTHONPATH=tree)  # the tree's own package first
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["median_s"]


def _step(med: dict) -> float:
    """The step's seconds: ``time/step`` (the loop's sum of its phases), else the phases' sum."""
    return med.get("time/step", sum(med.values()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", required=True, help="the other commit (any git revision)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", default="configs/arithmetic.py:grpo")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation)")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE (repeatable)")
    parser.add_argument("--json_out", default="")
    args = parser.parse_args()

    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    ref = subprocess.run(
        ["git", "rev-parse", args.ref], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    rounds = {"head": [], "ref": []}
    with tempfile.TemporaryDirectory(prefix="bench_ab_") as tmp:
        other = os.path.join(tmp, "ref")
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-q", other, ref], cwd=ROOT, check=True
        )
        try:
            for i in range(args.rounds):
                order = [("head", ROOT), ("ref", other)]
                for name, tree in order if i % 2 == 0 else order[::-1]:
                    med = _bench(tree, args, os.path.join(tmp, f"{name}{i}.json"))
                    rounds[name].append(med)
                    print(f"round {i} {name}: step {_step(med):.3f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", other], cwd=ROOT, check=False)
    step = {k: statistics.median(_step(m) for m in v) for k, v in rounds.items()}
    result = {
        "config": args.config,
        "set": args.set,
        "head": head,
        "ref": ref,
        "cpu": bench_step.cpu_info(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "rounds": rounds,
        "median_step_s": step,
        "head_over_ref": step["head"] / step["ref"],
    }
    print(
        f"median step: this tree {step['head']:.3f} s, {args.ref} {step['ref']:.3f} s "
        f"(ratio {result['head_over_ref']:.3f})"
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
