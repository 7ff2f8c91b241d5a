"""A/B: each row runs its prompt vs each group's prompt runs once (shared_prompt_forward).

  python benchmarks/bench_shared_prompt.py [--groups=1 --group_size=8 --prompt_len=159 \
      --completion_len=128]

SmolLM2-135M architecture (random weights; speed does not depend on the values), float32, one
CPU process, rows in groups of `group_size` identical prompts (a GRPO group). Times, best of
--repeats calls after compilation:
  * the log-prob forward (the reference pass) and loss + gradient (the update's core) of
    `steps.completion_logprobs` with group_size 1 and G, and the largest difference of values;
  * the sampler's prefill + 2 decode steps (`sampling.generate`, max_new_tokens=2) with
    `prompt_group_size` 1 and G.
The defaults are one micro-batch of issue #10's peer workload (8 rollouts of a 159-token
prompt, 128 new tokens).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def grouped_batch(
    vocab_size: int, groups: int, group_size: int, prompt_len: int, completion_len: int
):
    """A synthetic GRPO batch: `groups` random prompts of `prompt_len` tokens, each repeated for
    `group_size` rows and followed by random completions of `completion_len` tokens (seed 0).
    Returns (tokens [R, Lp + Lc] int32, mask [R, Lp + Lc] bool all True, advantages [R, 1]
    float32), R = groups x group_size."""
    import jax.numpy as jnp
    import numpy as np

    R = groups * group_size
    rng = np.random.default_rng(0)
    prompts = np.repeat(rng.integers(1, vocab_size, (groups, prompt_len)), group_size, axis=0)
    tokens = np.concatenate([prompts, rng.integers(1, vocab_size, (R, completion_len))], 1)
    adv = rng.normal(size=(R, 1))
    return (
        jnp.asarray(tokens, jnp.int32),
        jnp.ones((R, prompt_len + completion_len), bool),
        jnp.asarray(adv, jnp.float32),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=159)
    p.add_argument("--completion_len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from grpo_jax import sampling, steps
    from grpo_jax.models.config import get_preset
    from grpo_jax.models.transformer import Transformer

    cfg = get_preset("smollm2-135m")
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    G, Lp, Lc = a.group_size, a.prompt_len, a.completion_len
    tokens, mask, adv = grouped_batch(cfg.vocab_size, a.groups, G, Lp, Lc)

    def best(fn, *args):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t)
        return min(times)

    print(
        f"SmolLM2-135M, {a.groups} group(s) x {G} rows x ({Lp} prompt + {Lc} completion), best of "
        f"{a.repeats}; jax {jax.__version__}, {os.cpu_count()} CPUs"
    )
    out = {}
    for g in (1, G):
        fwd = jax.jit(lambda p, t, m, g=g: steps.completion_logprobs(graphdef, p, t, m, Lp, 1.0, g))
        grad = jax.jit(
            jax.grad(
                lambda p, t, m, g=g: (
                    -(steps.completion_logprobs(graphdef, p, t, m, Lp, 1.0, g) * adv).mean()
                )
            )
        )
        sc = sampling.SamplingConfig(max_new_tokens=2, temperature=1.0, prompt_group_size=g)
        gen = lambda p, g=g, sc=sc: (
            sampling.generate(
                graphdef, p, tokens[:, :Lp], mask[:, :Lp], jax.random.key(0), sc
            ).tokens
        )
        out[g] = fwd(params, tokens, mask)
        print(
            f"group_size {g}: forward {best(fwd, params, tokens, mask):7.2f} s   loss + grad "
            f"{best(grad, params, tokens, mask):7.2f} s   prefill + 2 tokens {best(gen, params):7.2f} s",
            flush=True,
        )
    print(f"max |logprob difference| {float(jnp.abs(out[1] - out[G]).max()):.2e}")


if __name__ == "__main__":
    main()
