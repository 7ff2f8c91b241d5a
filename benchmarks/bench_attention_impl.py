"""A/B on XLA:CPU: the training step's forward + backward with attention_impl einsum vs blockwise.

  python benchmarks/bench_attention_impl.py [--cases=arith,smol159,smol512] [--repeats=5]

Each case compiles ``jax.value_and_grad`` of a clipped-ratio-style loss on
``steps.completion_logprobs`` (the update's core; the shared-prompt forward where the case
says so) once per implementation, in one process, and then calls the two programs
interleaved (ABBA...), ``--repeats`` times each, so that drift of a loaded machine hits both
alike. It prints the machine, the versions, the load average before and after, each
implementation's median and the per-pair blockwise / einsum ratios, XLA's temporary-buffer
size of each compiled program, and the largest log-prob difference between the two.
Random weights (speed does not depend on the values). The cases:

  arith     configs/arithmetic.py's model (tiny preset, width 128, 2 layers, GQA 4:2, head 32)
            at one update mini-batch of that config: 128 rows x (16 prompt + 7 completion)
  arith64   the same model, 32 rows x (32 + 32): a longer toy sequence
  smol159   SmolLM2-135M, 8 rows (one group of 8, shared prompt) x (159 + 128): issue #10's
            peer micro-batch (benchmarks/bench_attention_remat.py's default)
  smol512   SmolLM2-135M, 4 rows (one group, shared prompt) x (512 + 512)
  smol1024  SmolLM2-135M, 2 rows (per row) x (1024 + 1024)
"""

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # XLA:CPU timings (no TPU/GPU plugin probing)

# name: (preset, overrides, rows, group, prompt_len, completion_len, shared prompt)
CASES = {
    "arith": (
        "tiny",
        dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32),
        128,
        4,
        16,
        7,
        False,
    ),
    "arith64": (
        "tiny",
        dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32),
        32,
        4,
        32,
        32,
        False,
    ),
    "smol159": ("smollm2-135m", {}, 8, 8, 159, 128, True),
    "smol512": ("smollm2-135m", {}, 4, 4, 512, 512, True),
    "smol1024": ("smollm2-135m", {}, 2, 1, 1024, 1024, False),
}
IMPLS = ("einsum", "blockwise")


def run_case(name, repeats):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from grpo_jax import steps
    from grpo_jax.models import transformer
    from grpo_jax.models.config import get_preset

    preset, overrides, R, G, Lp, Lc, shared = CASES[name]
    rng = np.random.default_rng(0)
    prompts = np.repeat(rng.integers(1, 100, (R // G, Lp)), G, axis=0)
    tokens = jnp.asarray(np.concatenate([prompts, rng.integers(1, 100, (R, Lc))], 1), jnp.int32)
    pm = np.arange(Lp)[None] >= rng.integers(0, Lp // 4 + 1, (R // G, 1))  # some left padding
    cm = np.arange(Lc)[None] < rng.integers(Lc // 2, Lc + 1, (R, 1))  # some right padding
    mask = jnp.asarray(np.concatenate([np.repeat(pm, G, 0), cm], 1))
    adv = jnp.asarray(rng.normal(size=(R, 1)), jnp.float32)
    cmf = jnp.asarray(cm, jnp.float32)
    group = G if shared else 1
    compiled, params, graphdefs = {}, None, {}
    for impl in IMPLS:
        cfg = get_preset(preset, **overrides, attention_impl=impl)
        graphdef, p = transformer.random_params(cfg, 0)
        params = p if params is None else params  # the same weights for both
        graphdefs[impl] = graphdef

        def loss(params, graphdef=graphdef):
            lp = steps.completion_logprobs(graphdef, params, tokens, mask, Lp, 1.0, group)
            obj = (jnp.exp(lp - jax.lax.stop_gradient(lp)) * adv * cmf).sum() / cmf.sum()
            return -obj, lp

        compiled[impl] = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params).compile()
    outs = {k: fn(params) for k, fn in compiled.items()}
    diff = float(jnp.abs((outs["einsum"][0][1] - outs["blockwise"][0][1]) * cmf).max())
    times = {k: [] for k in IMPLS}
    for i in range(repeats):
        for k in IMPLS if i % 2 == 0 else IMPLS[::-1]:
            t = time.perf_counter()
            jax.block_until_ready(compiled[k](params))
            times[k].append(time.perf_counter() - t)
    print(
        f"\n[{name}] {preset} {overrides or ''}: {R} rows x ({Lp} + {Lc}) tokens, "
        f"{'shared prompt (group ' + str(G) + ')' if shared else 'per row'}, {repeats} each"
    )
    for k in IMPLS:
        mem = compiled[k].memory_analysis()
        temp = mem.temp_size_in_bytes / 2**20 if mem is not None else float("nan")
        print(
            f"  {k:9s} median {np.median(times[k]):8.4f} s  (each: "
            f"{', '.join(f'{t:.3f}' for t in times[k])})  XLA temp {temp:8.1f} MiB"
        )
    ratios = [b / e for b, e in zip(times["blockwise"], times["einsum"])]
    print(
        f"  blockwise / einsum per pair: {', '.join(f'{r:.3f}' for r in ratios)} "
        f"(median {np.median(ratios):.3f}); max |log-prob difference| {diff:.2e}"
    )
    return float(np.median(ratios))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="arith,arith64,smol159,smol512")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    import jax
    import jaxlib

    print(
        f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"backend {jax.default_backend()}; load average before {os.getloadavg()}"
    )
    ratios = {name: run_case(name, a.repeats) for name in a.cases.split(",")}
    print(f"\nload average after {os.getloadavg()}")
    print("median blockwise / einsum: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
