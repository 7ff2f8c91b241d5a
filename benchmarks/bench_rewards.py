"""Reward throughput: completions per second of RewardFn on realistic completions.

Completions are MATH-500 reference solutions (each ends in a \\boxed{} answer); half of them get
their last boxed answer perturbed so that they are wrong. 1,024 completions = 2 passes over the
500 problems (+24) with distinct perturbations, so most (answer, gold) pairs are distinct.

Reported: worker start-up, a cold call (fresh workers, empty parse caches), a warm call (same
batch again: per-worker parse caches hit), and the arithmetic task (in-process).

Run: PYTHONPATH=. python benchmarks/bench_rewards.py [--workers 2] [--n 1024]
"""

from __future__ import annotations

import argparse
import random
import re
import time


def perturb(answer: str, rng: random.Random) -> str:
    """A different answer: change the first digit (or append "+1" when there is none).

    The first digit, not a random one: math-verify ignores units and base subscripts, so
    ``15\\mbox{ cm}^2`` -> ``^4`` or ``204_5`` -> ``204_7`` would still verify as correct.
    """
    m = re.search(r"\d", answer)
    if m is None:
        return answer + "+1"
    i = m.start()
    return answer[:i] + str((int(answer[i]) + rng.randint(1, 8)) % 10) + answer[i + 1 :]


def replace_last_boxed(solution: str, new: str) -> str:
    from grpo_jax.rewards.extract import last_boxed

    old = last_boxed(solution)
    k = solution.rfind("\\boxed")
    start = solution.index("{", k)
    end = start + 1 + solution[start + 1 :].index(old) + len(old)
    return solution[: start + 1] + new + solution[end:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--n", type=int, default=1024)
    args = parser.parse_args()

    from grpo_jax.data import datasets
    from grpo_jax.data.arithmetic import ArithmeticConfig, make_arithmetic
    from grpo_jax.rewards import RewardConfig, RewardFn

    rng = random.Random(0)
    math500 = datasets.load("math500", "test")
    completions, golds, expected = [], [], []
    for i in range(args.n):
        ex = math500[i % len(math500)]
        wrong = i % 2 == 1
        text = ex["solution"]
        if wrong:
            text = replace_last_boxed(text, perturb(ex["answer"], rng))
        completions.append(text)
        golds.append(ex["answer"])
        expected.append(not wrong)

    for fast_path in (True, False):
        t0 = time.perf_counter()
        fn = RewardFn(
            RewardConfig(
                task="math", num_workers=args.workers, timeout_s=10.0, integer_fast_path=fast_path
            )
        )
        fn(["\\boxed{x}"], ["x"])  # start the workers (an integer pair would not reach them)
        startup = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, correct, stats = fn(completions, golds)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        fn(completions, golds)
        warm = time.perf_counter() - t0
        fn.close()
        agree = sum(c == e for c, e in zip(correct, expected))
        print(
            f"math (MATH-500 solutions, half perturbed), n={args.n}, workers={args.workers}, "
            f"integer_fast_path={fast_path}"
        )
        print(f"  worker start-up           {startup:7.2f} s")
        print(f"  cold call                 {cold:7.2f} s  = {args.n / cold:8.1f} completions/s")
        print(f"  warm call (caches hit)    {warm:7.2f} s  = {args.n / warm:8.1f} completions/s")
        print(
            f"  correct {int(correct.sum())}/{args.n}; agrees with construction on {agree}/"
            f"{args.n}; distinct pairs {stats['num_checked']} (in-process integer "
            f"{stats['num_fast_path']}); timeouts {stats['num_timeouts']}, crashes "
            f"{stats['num_crashes']}"
        )

    gsm = datasets.load("gsm8k", "test")
    comps, gg = [], []
    for i in range(args.n):
        ex = gsm[i % len(gsm)]
        ans = ex["answer"] if i % 2 == 0 else str(float(ex["answer"]) + 1).removesuffix(".0")
        comps.append(ex["solution"].rsplit("####", 1)[0] + f"The answer is \\boxed{{{ans}}}.")
        gg.append(ex["answer"])
    with RewardFn(RewardConfig(task="math", num_workers=args.workers)) as gfn:
        t0 = time.perf_counter()
        _, c, st = gfn(comps, gg)
        dt = time.perf_counter() - t0
    print(
        f"math task on GSM8K solutions (integer golds), n={args.n}: {dt:.3f} s = "
        f"{args.n / dt:,.0f} completions/s (correct {int(c.sum())}, in-process integer fast "
        f"path {st['num_fast_path']}/{st['num_checked']} distinct pairs)"
    )

    train, _ = make_arithmetic(ArithmeticConfig(num_train=args.n, num_eval=0))
    comps = [
        ex["answer"] if i % 2 == 0 else str(int(ex["answer"]) + 1) for i, ex in enumerate(train)
    ]
    with RewardFn(RewardConfig(task="arithmetic")) as afn:
        t0 = time.perf_counter()
        _, c, _ = afn(comps, [ex["answer"] for ex in train])
        dt = time.perf_counter() - t0
    print(
        f"arithmetic, n={args.n}: {dt * 1e3:.2f} ms = {args.n / dt:,.0f} completions/s "
        f"(correct {int(c.sum())})"
    )


if __name__ == "__main__":
    main()
