"""Rollout-GDRO allocation cost: the host dynamic programme and the full `allocate` call.

Target (spec/issue): under 50 ms for 512 prompts x 10 bins x 11 arms (n_min 2 .. n_max 12,
n_bar 4, R = 2048). Prints median and p90 milliseconds over --repeats random states.

  python benchmarks/bench_gdro_dp.py [--prompts 512] [--bins 10] [--repeats 50]
"""

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import gdro


def timed(fn, repeats):
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append((time.perf_counter() - t0) * 1e3)
    return np.median(out), np.percentile(out, 90)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--bins", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    cfg = gdro.RolloutGDROConfig()  # arms 2..12 (11), n_bar 4
    rng = np.random.default_rng(0)
    bins = rng.integers(0, args.bins, args.prompts)
    counts = np.bincount(bins, minlength=args.bins)
    total = args.prompts * cfg.n_bar
    states = [
        gdro.rollout_gdro_init(cfg, args.bins).replace(
            scores=jnp.asarray(rng.normal(0, 1, (args.bins, cfg.num_arms)), jnp.float32),
            mu=jnp.asarray(rng.uniform(0, 0.3), jnp.float32),
        )
        for _ in range(args.repeats)
    ]
    logps = [np.log(gdro.arm_probs(cfg, s)) for s in states]
    it = iter(range(10**9))

    gdro.allocate(cfg, states[0], bins)  # warm-up (jit of helpers)
    dp_med, dp_p90 = timed(
        lambda: gdro.solve_arms_dp(
            logps[next(it) % args.repeats], counts, cfg.arms, total, cfg.n_bar
        ),
        args.repeats,
    )
    al_med, al_p90 = timed(
        lambda: gdro.allocate(cfg, states[next(it) % args.repeats], bins).segment_ids, args.repeats
    )
    sq = gdro.RolloutGDROConfig(allocator="sqrt")
    success = jnp.asarray(rng.random(args.bins), jnp.float32)
    jb = jnp.asarray(bins, jnp.int32)
    key = jnp.arange(args.prompts)
    gdro.sqrt_allocation(sq, jb, success, key, args.bins)
    sq_med, sq_p90 = timed(
        lambda: gdro.sqrt_allocation(sq, jb, success, key, args.bins), args.repeats
    )
    print(
        f"P={args.prompts} B={args.bins} K={cfg.num_arms} R={total} "
        f"(jax {jax.__version__}, {jax.devices()[0].platform})"
    )
    print(f"solve_arms_dp (numpy, host)   median {dp_med:7.2f} ms   p90 {dp_p90:7.2f} ms")
    print(f"allocate bandit (DP + ids)    median {al_med:7.2f} ms   p90 {al_p90:7.2f} ms")
    print(f"sqrt_allocation (jitted)      median {sq_med:7.2f} ms   p90 {sq_p90:7.2f} ms")


if __name__ == "__main__":
    main()
