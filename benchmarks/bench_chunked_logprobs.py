"""A/B on CPU: completion log-probs from the whole logits vs chunked from the hidden states.

  python benchmarks/bench_chunked_logprobs.py [--models=tiny,smollm2-135m --chunks=32,64,128
      --repeats=7 --rows=4 --prompt_len=32 --completion_len=256 --layers=0]

For each model (random weights, float32, one CPU process) it times the jitted loss + gradient
(forward and backward) of `steps.completion_logprobs` with `logprob_chunk_size` 0 (the
[R, Lc, V] logits, then `logprobs.logprobs_from_logits`) and with each of `--chunks`
(`logprobs.logprobs_from_hidden`: the LM head and the log-softmax a chunk of positions at a time,
the logits never whole), and prints, per variant, the median and best of `--repeats` calls
(seconds), the ratio of medians to the whole-logits path and XLA's temporary bytes of the
compiled program. The variants are interleaved (each repeat runs every variant once, in a
rotated order), so a background load that comes and goes hits them alike; the load average
before and after is printed, and timings on a loaded machine are only comparable within one
run. `--layers` > 0 overrides the number of decoder layers (the LM head's share of the time
grows as the trunk shrinks). Prints the machine (CPU model, core count) and the versions.
"""

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _machine() -> str:
    from benchmarks.bench_step import cpu_info

    info = cpu_info()
    return (
        f"{info.get('model_name') or platform.processor() or 'unknown CPU'} "
        f"({info.get('simd', '')}), {os.cpu_count()} CPUs, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}"
    )


def bench_model(name, a, jax, jnp, np):
    from grpo_jax import steps
    from grpo_jax.models import transformer
    from grpo_jax.models.config import get_preset

    cfg = get_preset(name)
    if a.layers:
        cfg = cfg.replace(num_layers=a.layers)
    graphdef, params = transformer.random_params(cfg, seed=0)
    Lp, Lc, R = a.prompt_len, a.completion_len, a.rows
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (R, Lp + Lc)), jnp.int32)
    mask = jnp.ones((R, Lp + Lc), bool)
    adv = jnp.asarray(rng.normal(size=(R, 1)), jnp.float32)

    def compiled(chunk):
        def loss(p, t, m):
            lp = steps.completion_logprobs(graphdef, p, t, m, Lp, 1.0, 1, chunk)
            return -(lp * adv).mean()

        return jax.jit(jax.value_and_grad(loss)).lower(params, tokens, mask).compile()

    variants = [0] + [c for c in a.chunks if c > 0]
    fns = {}
    for chunk in variants:
        t = time.perf_counter()
        fns[chunk] = compiled(chunk)
        jax.block_until_ready(fns[chunk](params, tokens, mask))  # warm-up
        print(f"  compiled chunk={chunk} in {time.perf_counter() - t:.1f} s", flush=True)
    times = {c: [] for c in variants}
    for rep in range(a.repeats):
        k = rep % len(variants)
        for chunk in variants[k:] + variants[:k]:
            t = time.perf_counter()
            jax.block_until_ready(fns[chunk](params, tokens, mask))
            times[chunk].append(time.perf_counter() - t)
    base = statistics.median(times[0])
    print(
        f"{name}: V = {cfg.vocab_size}, E = {cfg.hidden_size}, {cfg.num_layers} layers, "
        f"tied = {cfg.tie_word_embeddings}; {R} rows x ({Lp} prompt + {Lc} completion) "
        f"positions; loss + grad; {a.repeats} interleaved timed calls per variant"
    )
    print(f"  {'variant':<22}{'median s':>10}{'best s':>10}{'vs whole':>10}{'XLA temp MiB':>14}")
    for chunk in variants:
        med = statistics.median(times[chunk])
        temp = getattr(fns[chunk].memory_analysis(), "temp_size_in_bytes", 0) / 2**20
        label = "whole logits (0)" if chunk == 0 else f"chunked, {chunk} positions"
        print(
            f"  {label:<22}{med:>10.3f}{min(times[chunk]):>10.3f}{med / base:>10.2f}{temp:>14.1f}",
            flush=True,
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,smollm2-135m")
    p.add_argument("--chunks", default="32,64,128")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--completion_len", type=int, default=256)
    p.add_argument("--layers", type=int, default=0, help="override num_layers (0 = preset's)")
    a = p.parse_args()
    a.chunks = [int(c) for c in a.chunks.split(",") if c]

    import flax
    import jax
    import jax.numpy as jnp
    import jaxlib
    import numpy as np

    print(f"machine: {_machine()}")
    print(
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, flax {flax.__version__}, "
        f"backend {jax.default_backend()}"
    )
    print(f"load average (1, 5, 15 min) before: {os.getloadavg()}")
    for name in a.models.split(","):
        bench_model(name, a, jax, jnp, np)
    print(f"load average (1, 5, 15 min) after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
