"""A/B of the sampler's decode cache layouts: "dense" vs "prefix_shared" vs "paged" decode tokens/s.

  python benchmarks/bench_decode_cache.py                     # SmolLM2-135M shape, 2 x 8 rows
  python benchmarks/bench_decode_cache.py --num_layers=8 --prompt_len=512 --out=/tmp/dc.json

Random weights of a `models.get_preset` shape (``--num_layers`` overrides its depth; speed
does not depend on the values), ``--groups`` prompts of ``--prompt_len`` tokens, each repeated
for ``--group_size`` rows (a GRPO group; `SamplingConfig.prompt_group_size`), EOS disabled so
every row decodes every step. For each layout the sampler (`sampling.generate`, temperature 1)
runs with N and with 2 new tokens; the difference is N - 2 decode steps, so prefill and
compilation drop out: decode step s = (t_N - t_2) / (N - 2), decode tok/s = rows / step s
(best of ``--repeats``, the layouts alternated). Beside each: the analytic bytes one decode
step reads per token (`sampling.decode_read_bytes`: parameters, prompt keys/values,
completion keys/values, with the sampler's attention buckets), and whether the two layouts
sampled the same tokens from the same key as "dense" ("paged": the XLA path on a CPU, whose
reads are the shared pages once per group and each row's own pages, not the Pallas kernel's
that ``decode_read_bytes(layout="paged")`` counts).

Writes a JSON summary (machine, versions, arguments, results) with --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def machine() -> dict:
    """The host and the library versions of this process."""
    import flax
    import jax
    import jaxlib
    import numpy as np

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = ""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "numpy": np.__version__,
        "git_commit": commit,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="a models.get_preset name")
    p.add_argument("--num_layers", type=int, default=0, help="override the depth (0: preset's)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--new_tokens", type=int, default=34)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 (weights, KV)")
    p.add_argument("--layouts", default="dense,prefix_shared", help="comma-separated, dense first")
    p.add_argument("--page_size", type=int, default=16, help="the paged layout's")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from grpo_jax.models import get_preset
    from grpo_jax.models.transformer import random_params
    from grpo_jax.sampling import SamplingConfig, decode_read_bytes, generate, kv_bytes_per_slot

    over = {"num_layers": args.num_layers} if args.num_layers else {}
    cfg = get_preset(args.model, dtype=args.dtype, param_dtype=args.dtype, **over)
    graphdef, params = random_params(cfg, 0)
    param_bytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))
    G, Lp, N = args.group_size, args.prompt_len, args.new_tokens
    R = args.groups * G
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, cfg.vocab_size, (args.groups, Lp))
    toks = jnp.asarray(np.repeat(prompts, G, axis=0), jnp.int32)
    mask = jnp.ones((R, Lp), bool)
    base = SamplingConfig(
        max_new_tokens=N, temperature=1.0, prompt_group_size=G, page_size=args.page_size
    )
    layouts = tuple(args.layouts.split(","))
    if layouts[0] != "dense":
        raise SystemExit("--layouts must start with dense (the reference)")

    def run(layout, n, seed):
        sc = dataclasses.replace(base, decode_cache=layout, max_new_tokens=n)
        t = time.perf_counter()
        out = generate(graphdef, params, toks, mask, jax.random.key(seed), sc)
        out.completion_tokens.block_until_ready()
        return time.perf_counter() - t, out

    samples = {}
    for layout in layouts:  # compile both lengths of both layouts
        samples[layout] = run(layout, N, 0)[1]
        run(layout, 2, 0)
    best = {(layout, n): float("inf") for layout in layouts for n in (N, 2)}
    for s in range(args.repeats):
        for layout in layouts:
            for n in (N, 2):
                best[layout, n] = min(best[layout, n], run(layout, n, s + 1)[0])
    results = {}
    for layout in layouts:
        step = (best[layout, N] - best[layout, 2]) / (N - 2)
        reads = decode_read_bytes(
            param_bytes=param_bytes,
            kv_bytes_per_slot=kv_bytes_per_slot(cfg),
            rows=R,
            group_size=G,
            prompt_len=Lp,
            new_tokens=N,
            layout=layout,
            buckets=base.attention_buckets,
            page_size=args.page_size,
        )
        results[layout] = {
            "decode_step_s": step,
            "decode_tok_s": R / step,
            "read_bytes_per_token": reads,
            "prefill_plus_2_s": best[layout, 2],
        }
        print(
            f"{layout:14s} decode step {step * 1e3:8.1f} ms = {R / step:8.1f} tok/s; reads per "
            f"token {reads['total'] / 2**20:7.2f} MiB (params {reads['params'] / 2**20:.2f}, "
            f"prompt {reads['prefix'] / 2**20:.2f}, completion {reads['completion'] / 2**20:.2f})",
            flush=True,
        )
    summary = {
        "machine": machine(),
        "args": vars(args),
        "model": {"preset": args.model, **over, "param_bytes": param_bytes, "rows": R},
        "results": results,
    }
    ref = samples["dense"]
    for layout in layouts[1:]:
        same = bool(np.array_equal(ref.completion_tokens, samples[layout].completion_tokens))
        dlp = float(np.max(np.abs(ref.logprobs - samples[layout].logprobs)))
        speedup = results[layout]["decode_tok_s"] / results["dense"]["decode_tok_s"]
        print(
            f"{layout} / dense decode tok/s: {speedup:.3f}; same tokens {same}, |dlogp| {dlp:.2e}"
        )
        summary[f"speedup_{layout}"] = speedup
        results[layout].update(same_tokens=same, max_abs_logprob_diff=dlp)
    if "prefix_shared" in layouts:  # the keys of the committed reports/decode_cache_*.json
        summary["same_tokens"] = results["prefix_shared"]["same_tokens"]
        summary["max_abs_logprob_diff"] = results["prefix_shared"]["max_abs_logprob_diff"]
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
