"""A/B: the attention probabilities stored for the backward pass vs recomputed there.

  python benchmarks/bench_attention_remat.py [--groups=1 --group_size=8 --prompt_len=159 \
      --completion_len=128 --pairs=4 --shared=1]

SmolLM2-135M architecture (random weights; speed does not depend on the values), float32, one
CPU process. Both variants of the update's core (loss + gradient of `steps.completion_logprobs`
with a clipped-ratio-style loss) are compiled in the same process: "recompute" is the library
(`transformer.recompute_in_backward`), "store" replaces that wrapper by the identity at trace
time, so autodiff keeps the softmax probabilities of every layer. The calls alternate (ABBA...)
so that the machine's drift hits both alike; the script prints each variant's median, the
per-pair ratios, XLA's temporary-buffer size of each compiled program and the largest
difference of the gradients. The defaults are one micro-batch of issue #10's peer workload (8
rollouts of a 159-token prompt, 128 new tokens, each group's prompt run once).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=159)
    p.add_argument("--completion_len", type=int, default=128)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--shared", type=int, default=1, help="1: each group's prompt runs once")
    p.add_argument("--preset", default="smollm2-135m")
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_shared_prompt import grouped_batch
    from flax import nnx

    from grpo_jax import steps
    from grpo_jax.models import transformer
    from grpo_jax.models.config import get_preset

    cfg = get_preset(a.preset)
    graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    G, Lp, Lc = a.group_size, a.prompt_len, a.completion_len
    tokens, mask, adv = grouped_batch(cfg.vocab_size, a.groups, G, Lp, Lc)
    group = G if a.shared else 1

    def loss(params, tokens, mask):
        lp = steps.completion_logprobs(graphdef, params, tokens, mask, Lp, 1.0, group)
        return -(jnp.exp(lp - jax.lax.stop_gradient(lp)) * adv).mean()

    library = transformer.recompute_in_backward
    compiled = {}
    for name, wrapper in (("store", lambda fn, static_argnums=(): fn), ("recompute", library)):
        transformer.recompute_in_backward = wrapper  # read at trace time by the attention
        try:
            lowered = jax.jit(jax.value_and_grad(loss)).lower(params, tokens, mask)
        finally:
            transformer.recompute_in_backward = library
        compiled[name] = lowered.compile()
    grads = {k: fn(params, tokens, mask)[1] for k, fn in compiled.items()}
    diff = max(
        float(jnp.abs(x - y).max())
        for x, y in zip(jax.tree.leaves(grads["store"]), jax.tree.leaves(grads["recompute"]))
    )
    times = {k: [] for k in compiled}
    for i in range(a.pairs):
        order = ("store", "recompute") if i % 2 == 0 else ("recompute", "store")
        for k in order:
            t = time.perf_counter()
            jax.block_until_ready(compiled[k](params, tokens, mask))
            times[k].append(time.perf_counter() - t)
    print(
        f"{a.preset}, {a.groups} group(s) x {G} rows x ({Lp} prompt + {Lc} completion), "
        f"shared prompt {bool(a.shared)}, {a.pairs} alternated pairs; jax {jax.__version__}, "
        f"{os.cpu_count()} CPUs"
    )
    for k, fn in compiled.items():
        mem = fn.memory_analysis()
        temp = getattr(mem, "temp_size_in_bytes", 0) / 2**30 if mem is not None else float("nan")
        print(
            f"{k:9s} loss + grad median {np.median(times[k]):7.3f} s  "
            f"(each: {', '.join(f'{t:.2f}' for t in times[k])})  XLA temp {temp:.2f} GiB"
        )
    ratios = [r / s for r, s in zip(times["recompute"], times["store"])]
    print(
        f"recompute / store per pair: {', '.join(f'{r:.3f}' for r in ratios)} "
        f"(median {np.median(ratios):.3f}); max |gradient difference| {diff:.2e}"
    )


if __name__ == "__main__":
    main()
