"""A/B: log-probs with the LM head on every position vs on the completion positions only.

  python benchmarks/bench_lm_head.py [--rows=16 --prompt_len=108 --completion_len=32]

SmolLM2-135M architecture (random weights: speed and memory do not depend on the values),
float32, one CPU process. Times the jitted forward (the reference pass) and loss + gradient (the
update's core) for both variants, best and median of --repeats calls after compilation, and
prints XLA's temporary bytes of each compiled program. `grpo_jax.steps.completion_logprobs` is
the completion-only variant; `full_head_logprobs` below is what it replaced.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def full_head_logprobs(graphdef, params, tokens, attention_mask, prompt_len, temperature):
    """The previous completion_logprobs: [R, Lp + Lc - 1, V] logits, then the Lc positions."""
    from flax import nnx

    from grpo_jax import logprobs as logprobs_lib
    from grpo_jax.models.transformer import positions_from_mask

    model = nnx.merge(graphdef, params)
    positions = positions_from_mask(attention_mask)
    logits, _ = model(tokens[:, :-1], positions[:, :-1], attention_mask[:, :-1])
    return logprobs_lib.logprobs_from_logits(
        logits[:, prompt_len - 1 :], tokens[:, prompt_len:], temperature
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt_len", type=int, default=108)
    p.add_argument("--completion_len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from grpo_jax import steps
    from grpo_jax.models.config import get_preset
    from grpo_jax.models.transformer import Transformer

    cfg = get_preset("smollm2-135m")
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    L = a.prompt_len + a.completion_len
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (a.rows, L)), jnp.int32)
    mask = jnp.ones((a.rows, L), bool)
    adv = jnp.asarray(rng.normal(size=(a.rows, 1)), jnp.float32)

    def timed(fn, *args):
        compiled = jax.jit(fn).lower(*args).compile()
        jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t)
        mem = compiled.memory_analysis()
        return min(times), statistics.median(times), getattr(mem, "temp_size_in_bytes", 0) / 2**30

    print(
        f"SmolLM2-135M, {a.rows} rows x ({a.prompt_len} prompt + {a.completion_len} completion), "
        f"{a.repeats} timed calls each; jax {jax.__version__}, {os.cpu_count()} CPUs"
    )
    print(f"{'variant':<28}{'program':<16}{'best s':>9}{'median s':>10}{'temp GiB':>10}")
    for name, fn in (
        ("LM head on every position", full_head_logprobs),
        ("LM head on completion only", steps.completion_logprobs),
    ):
        fwd = lambda p, t, m, fn=fn: fn(graphdef, p, t, m, a.prompt_len, 1.0)
        grad = jax.grad(lambda p, t, m, fn=fn: -(fwd(p, t, m) * adv).mean())
        for prog, f in (("forward", fwd), ("loss + grad", grad)):
            best, med, temp = timed(f, params, tokens, mask)
            print(f"{name:<28}{prog:<16}{best:>9.2f}{med:>10.2f}{temp:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
