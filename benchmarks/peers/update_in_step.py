"""The update alone vs inside the step, paired in one process (same workload as run_grpo_jax.py).

  python benchmarks/peers/update_in_step.py --prompts=16 --samples=8 --max_new_tokens=128 \
      --micro_batch=8 [--pairs=2]

After a warm-up step (compilation), each pair runs one `grpo_jax.train.rl_step` (its phase
times printed) and then the same jitted training program (`Steps.train`) twice more on the
batch and state that step's update received (the state copied before its update, which
donates it). If the update alone is as fast as the step's update phase, nothing the step does
before it (generation's memory, the real batch) slows it down. The step's update phase here
includes that copy of the state (parameters + optimizer state, ~1.6 GB for SmolLM2-135M,
well under a second), so it reads slightly high.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
from run_grpo_jax import make_config

sys.path.insert(0, common.REPO)


def main(argv=None):
    p = common.add_workload_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--pairs", type=int, default=2)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from grpo_jax import steps as steps_lib
    from grpo_jax import train
    from grpo_jax.experiment import build_experiment

    prompts = common.load_prompts(args.prompts)
    exp = build_experiment(make_config(args, max(len(q["ids"]) for q in prompts)))
    run, _ = steps_lib.init_run(exp, warm_start=False)
    fns = steps_lib.make_steps(exp)
    seen = {}

    def train_and_keep(state, batch, key):  # keeps the update's inputs (state copied: donated)
        seen.update(
            batch=batch, key=key, state=jax.block_until_ready(jax.tree.map(jnp.copy, state))
        )
        return fns.train(state, batch, key)

    step_fns = dataclasses.replace(fns, train=train_and_keep)
    clock = {"t0": time.perf_counter()}

    def pair(result) -> None:  # after each step: its time, then the same update alone, twice
        jax.block_until_ready(result.run.train.params)
        i, row = int(result.run.train.step) - 1, result.row
        tag = "warm-up" if i == 0 else f"pair {i}"
        print(
            f"[update_in_step] {tag}: step {time.perf_counter() - clock['t0']:.1f} s (generate "
            f"{row['time/generate']:.1f}, reference {row['time/reference']:.1f}, update "
            f"{row['time/update']:.1f})",
            flush=True,
        )
        for _ in range(2 if i else 0):
            state = jax.block_until_ready(jax.tree.map(jnp.copy, seen["state"]))
            t0 = time.perf_counter()
            jax.block_until_ready(fns.train(state, seen["batch"], seen["key"]))
            print(
                f"[update_in_step] {tag}: update alone {time.perf_counter() - t0:.1f} s", flush=True
            )
        clock["t0"] = time.perf_counter()

    until = int(run.train.step) + args.pairs + 1
    train.run_steps(exp, step_fns, run, exp.make_source(), until=until, hooks=(pair,))
    exp.close()


if __name__ == "__main__":  # the reward verifier's worker processes re-import this module
    main()
