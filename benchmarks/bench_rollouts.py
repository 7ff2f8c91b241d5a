"""Static vs continuous batching on long-tailed completion lengths (issue #21).

  python -m benchmarks.bench_rollouts --out=reports/rollouts.json            # CPU default
  python -m benchmarks.bench_rollouts --preset=smollm2-135m --requests=512 --slots=128 \\
      --max_new_tokens=1024 --dtype=bfloat16 --out=/tmp/rollouts.json          # a GPU / TPU
  python -m benchmarks.bench_rollouts --dists=gsm8k --lengths_file=reports/gsm8k_lengths.json \\
      --max_new_tokens=512                                                     # real lengths

R requests (prompts of ``--prompt_len`` random tokens, random weights of ``--preset``) with
completion budgets drawn from a long-tailed distribution (EOS disabled, so a request ends at its
budget: the lengths are exactly the drawn ones for every sampler):

* ``lognormal``: ``1 + LogNormal(mu, sigma)`` clipped to ``max_new_tokens`` (mean ~ Lc / 8).
* ``pareto``: ``Lc / 16 x (1 + Pareto(1.2))`` clipped to ``max_new_tokens`` (a heavier tail).
* ``gsm8k``: drawn with replacement (seeded) from the real completion lengths of
  ``--lengths_file`` (a JSON list of ints, or an object with key ``"lengths"``; made by
  ``benchmarks/gsm8k_lengths.py``: SmolLM2-135M-Instruct on GSM8K train prompts), clipped to
  ``[1, max_new_tokens]``.

Samplers, each with the same decode width S = ``--slots`` rows (the same KV-cache memory):

* ``static``: ``sampling.generate`` on R / S consecutive batches of S requests; a batch runs until
  its longest request ends.
* ``continuous``: ``sampling.generate_continuous(num_slots=S)``: a finished request's slot takes
  the next pending one; the drain at the end halves the batch (`SlotStats`).

Reported per distribution: wall seconds (median of ``--repeats`` after a compile run), slot
utilisation (useful slot-steps / slot-steps run; static: sum of lengths / sum over batches of
S x the batch's longest) and the wall-time ratio continuous / static. Numbers are printed and
written to ``--out`` (JSON); nothing is asserted (tests/test_sampling_continuous.py tests it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np


def read_lengths(path: str) -> np.ndarray:
    """The completion lengths of a file: a JSON list of ints or an object with ``"lengths"``.

    Raises: ValueError if the file holds no lengths or non-positive ones.
    """
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):
        if "lengths" not in data:
            raise ValueError(f"{path}: a JSON object needs the key 'lengths'")
        data = data["lengths"]
    x = np.asarray(data)
    if x.ndim != 1 or x.size == 0 or not np.issubdtype(x.dtype, np.integer) or (x < 1).any():
        raise ValueError(f"{path}: expected a non-empty list of positive ints")
    return x.astype(np.int64)


def draw_lengths(
    dist: str, n: int, max_new_tokens: int, seed: int = 0, lengths_file: str = ""
) -> np.ndarray:
    """[n] int32 completion budgets in [1, max_new_tokens] (see the module docstring)."""
    rng = np.random.default_rng(seed)
    lc = int(max_new_tokens)
    if dist == "gsm8k":
        if not lengths_file:
            raise ValueError("dist 'gsm8k' needs --lengths_file (benchmarks/gsm8k_lengths.py)")
        x = rng.choice(read_lengths(lengths_file), n, replace=True)
    elif dist == "lognormal":
        sigma = 1.0
        mu = np.log(lc / 8) - sigma**2 / 2  # mean lc / 8 before clipping
        x = 1 + rng.lognormal(mu, sigma, n)
    elif dist == "pareto":
        x = lc / 16 * (1 + rng.pareto(1.2, n))
    else:
        raise ValueError(f"dist {dist!r}: lognormal | pareto | gsm8k")
    return np.clip(x.astype(np.int64), 1, lc).astype(np.int32)


def static_utilisation(lengths: np.ndarray, slots: int) -> float:
    """Useful decode slot-steps / slot-steps run by static batches of ``slots`` requests."""
    work = np.maximum(lengths - 1, 0)
    run = sum(slots * int(work[i : i + slots].max()) for i in range(0, len(work), slots))
    return float(work.sum() / max(run, 1))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", help="grpo_jax.models preset (random weights)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--dists", default="lognormal,pareto", help="lognormal,pareto,gsm8k")
    ap.add_argument(
        "--lengths_file", default="", help="JSON of real completion lengths (dist gsm8k)"
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from grpo_jax.models import get_preset
    from grpo_jax.models.transformer import random_params
    from grpo_jax.sampling import SamplingConfig, generate, generate_continuous

    cfg = get_preset(args.preset, dtype=args.dtype)
    graphdef, params = random_params(cfg, args.seed)
    R, S, Lp, Lc = args.requests, args.slots, args.prompt_len, args.max_new_tokens
    rng = np.random.default_rng(args.seed)
    toks = jnp.asarray(rng.integers(1, cfg.vocab_size, (R, Lp)), jnp.int32)
    mask = jnp.ones((R, Lp), bool)
    sc = SamplingConfig(max_new_tokens=Lc, temperature=1.0, eos_ids=())

    def timed(fn):
        jax.block_until_ready(fn())  # compile
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn())
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)), out

    results = {}
    for dist in [d for d in args.dists.split(",") if d]:
        lengths = draw_lengths(dist, R, Lc, args.seed, args.lengths_file)
        lens = jnp.asarray(lengths)

        def static():
            return [
                generate(
                    graphdef,
                    params,
                    toks[i : i + S],
                    mask[i : i + S],
                    jax.random.key(i),
                    sc,
                    max_lengths=lens[i : i + S],
                )
                for i in range(0, R, S)
            ]

        def continuous():
            return generate_continuous(
                graphdef,
                params,
                toks,
                mask,
                jax.random.key(0),
                sc,
                num_slots=S,
                max_lengths=lens,
            )

        t_static, outs = timed(static)
        t_cont, (out, st) = timed(continuous)
        got = np.concatenate([np.asarray(o.lengths) for o in outs])
        assert np.array_equal(got, lengths) and np.array_equal(np.asarray(out.lengths), lengths)
        results[dist] = {
            "mean_length": float(lengths.mean()),
            "max_length": int(lengths.max()),
            "p99_length": float(np.percentile(lengths, 99)),
            "static_seconds": t_static,
            "continuous_seconds": t_cont,
            "wall_ratio_continuous_over_static": t_cont / t_static,
            "static_utilisation": static_utilisation(lengths, S),
            "continuous_utilisation": float(st.utilisation),
            "continuous_iterations": int(st.iterations),
            "tokens_per_s_static": float(lengths.sum() / t_static),
            "tokens_per_s_continuous": float(lengths.sum() / t_cont),
        }
        if dist == "gsm8k":
            results[dist]["lengths_file"] = args.lengths_file
            results[dist]["clipped_fraction"] = float(np.mean(lengths == Lc))
        r = results[dist]
        print(
            f"{dist:9s} lengths mean {r['mean_length']:.1f} max {r['max_length']}: static "
            f"{t_static:.2f}s (utilisation {r['static_utilisation']:.1%}), continuous "
            f"{t_cont:.2f}s (utilisation {r['continuous_utilisation']:.1%}); ratio "
            f"{r['wall_ratio_continuous_over_static']:.2f}",
            flush=True,
        )
    res = {
        "settings": vars(args),
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "results": results,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(markdown(res, argv))
    return res


def markdown(res: dict, argv=None) -> str:
    """The report of one run (``--out`` with ``.md``)."""
    import sys

    a = res["settings"]
    cmd = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        "# Static vs continuous batching on long-tailed completion lengths\n",
        f"Command: `python -m benchmarks.bench_rollouts {cmd}`\n",
        f"Machine: {res['cpus']} CPU core(s) ({res['machine']}), backend {res['backend']} "
        f"({res['device']}), jax {res['jax']}. Model: `{a['preset']}` preset, random weights, "
        f"{a['dtype']}; {a['requests']} requests x prompt {a['prompt_len']} tokens, at most "
        f"{a['max_new_tokens']} new tokens, EOS disabled (each request ends at its drawn budget); "
        f"both samplers decode {a['slots']} rows at a time (the same KV-cache memory); wall = "
        f"median of {a['repeats']} runs after a compile run.\n",
        "| lengths | mean | p99 | max | static s | continuous s | ratio | static utilisation "
        "| continuous utilisation |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d, r in res["results"].items():
        lines.append(
            f"| {d} | {r['mean_length']:.1f} | {r['p99_length']:.0f} | {r['max_length']} | "
            f"{r['static_seconds']:.2f} | {r['continuous_seconds']:.2f} | "
            f"{r['wall_ratio_continuous_over_static']:.2f} | {r['static_utilisation']:.1%} | "
            f"{r['continuous_utilisation']:.1%} |"
        )
    if "gsm8k" in res["results"]:
        r = res["results"]["gsm8k"]
        lines.append(
            f"\n`gsm8k` lengths: drawn with replacement from the real completion lengths in "
            f"`{r['lengths_file']}` (benchmarks/gsm8k_lengths.py), clipped to "
            f"{a['max_new_tokens']} ({r['clipped_fraction']:.1%} of the draws at the cap)."
        )
    lines.append(
        "\nUtilisation = decode slot-steps that produced a token of a live request / slot-steps "
        "run. Static: batches of S requests, each running until its longest request ends. "
        "Continuous: a finished request's slot takes the next pending request (its prompt's "
        "keys/values copied from a prompt cache filled by one batched prefill); once nothing is "
        "pending the live slots move to batches half as wide.\n"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
