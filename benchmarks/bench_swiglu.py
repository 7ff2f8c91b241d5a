"""A/B: the MLP's SwiGLU by plain autodiff vs grpo_jax's custom VJP (`transformer.swiglu`).

  python benchmarks/bench_swiglu.py [--rows=8 --prompt_len=159 --completion_len=128]

SmolLM2-135M architecture (random weights), float32, one CPU process: times the jitted
loss + gradient of `steps.completion_logprobs` (the update's core) with
`jax.nn.silu(g) * u` (autodiff keeps sigmoid, silu, g and u of every layer for the backward
pass) and with `swiglu` (keeps g and u, recomputes the sigmoid), best and median of --repeats
calls after compilation, and the model FLOP/s of each (6 x layer parameters x positions + the
LM head on the completion positions). Issue #10's profile found the MLP backward's transposing
copies (`copy_bitcast_fusion` in a jax.profiler trace) at ~25% of the gradient's time.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=159)
    p.add_argument("--completion_len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from grpo_jax import steps
    from grpo_jax.models import transformer
    from grpo_jax.models.config import get_preset

    cfg = get_preset("smollm2-135m")
    graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    L = a.prompt_len + a.completion_len
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (a.rows, L)), jnp.int32)
    mask = jnp.ones((a.rows, L), bool)
    adv = jnp.asarray(rng.normal(size=(a.rows, 1)), jnp.float32)
    n_head = cfg.vocab_size * cfg.hidden_size
    n_body = sum(x.size for x in jax.tree.leaves(params)) - n_head
    flops = 6 * n_body * a.rows * (L - 1) + 6 * n_head * a.rows * a.completion_len

    def loss(p, t, m):
        return -(steps.completion_logprobs(graphdef, p, t, m, a.prompt_len, 1.0) * adv).mean()

    print(
        f"SmolLM2-135M, {a.rows} rows x ({a.prompt_len} + {a.completion_len}) positions, "
        f"loss + grad, {a.repeats} timed calls; jax {jax.__version__}, {os.cpu_count()} CPUs"
    )
    ours = transformer.swiglu
    for name, fn in (
        ("autodiff of silu(g) * u", lambda g, u: jax.nn.silu(g) * u),
        ("swiglu custom VJP", ours),
    ):
        transformer.swiglu = fn  # MLP.__call__ looks the name up at trace time
        try:
            compiled = jax.jit(jax.grad(loss)).lower(params, tokens, mask).compile()
        finally:
            transformer.swiglu = ours
        jax.block_until_ready(compiled(params, tokens, mask))
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            jax.block_until_ready(compiled(params, tokens, mask))
            times.append(time.perf_counter() - t)
        temp = getattr(compiled.memory_analysis(), "temp_size_in_bytes", 0) / 2**30
        print(
            f"{name:<26} best {min(times):7.2f} s  median {statistics.median(times):7.2f} s  "
            f"{flops / min(times) / 1e9:6.1f} GFLOP/s  XLA temp {temp:.2f} GiB",
            flush=True,
        )


if __name__ == "__main__":
    main()
