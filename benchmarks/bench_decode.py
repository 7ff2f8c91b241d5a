"""Decode speed vs the memory-bandwidth bound (issue #10): grpo_jax's sampler on SmolLM2-135M.

  python benchmarks/bench_decode.py                          # rows 1, 16, 128; prompt 159
  python benchmarks/bench_decode.py --rows=1,8 --new_tokens=16
  python benchmarks/bench_decode.py --random=smollm2-135m     # random weights, no checkpoint
  python benchmarks/bench_decode.py --random=smollm2-135m --dtype=bfloat16   # a GPU / TPU

For each batch size B the sampler (`grpo_jax.sampling.generate`, ``--dtype`` weights and KV
cache, EOS disabled so every row decodes every step) runs twice, with N and with 2 new tokens;
the difference is N - 2 decode steps, so prefill and compilation drop out:
decode step s = (t_N - t_2) / (N - 2), decode tok/s = B / decode step s.

Bound: one decode step must read every weight once (their bytes, the tied embedding included
since it is the LM head) and, per row, the keys and values of every position so far
(2 x layers x kv_heads x head_dim x itemsize x (Lp + t)); at bandwidth BW that takes at least
(weights + KV) / BW, so bandwidth-bound tok/s = B x BW / (weights + KV), with KV at the mean
position of the timed steps. BW: on a CPU, measured in the same process (the best of a jitted
float32 sum over a 1 GiB array and numpy's); on a GPU/TPU listed in `experiments.aot.CHIPS`,
the chip's published HBM bandwidth (sources in that table; the measured one is kept in the
JSON). The ``--dtype`` matmul peak, measured in the same process (compute bound: peak /
(2 x matmul parameters) tokens/s, whatever the batch), is printed alongside: from a few dozen
rows on, the bandwidth bound exceeds it and the compute bound is the machine's real limit.

Writes a JSON summary with --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> dict:
    """Best-of read bandwidth (bytes/s) of a jitted jnp.sum and of numpy's sum over `gib` GiB."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = int(gib * 2**30) // 4
    x = np.random.default_rng(0).random(n, dtype=np.float32)
    xd = jnp.asarray(x)
    f = jax.jit(jnp.sum)
    f(xd).block_until_ready()
    best_jax = best_np = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(xd).block_until_ready()
        best_jax = min(best_jax, time.perf_counter() - t)
        t = time.perf_counter()
        np.add.reduce(x)
        best_np = min(best_np, time.perf_counter() - t)
    return {
        "jax_sum": 4 * n / best_jax,
        "numpy_sum": 4 * n / best_np,
        "best": max(4 * n / best_jax, 4 * n / best_np),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint",
        default="",
        help="HF safetensors dir (default: the peers' converted SmolLM2, or the "
        "bench_sampler conversion)",
    )
    parser.add_argument(
        "--random",
        default="",
        help="a models.get_preset name: random float32 weights of that shape instead of a "
        "checkpoint (e.g. smollm2-135m)",
    )
    parser.add_argument("--rows", default="1,16,128")
    parser.add_argument("--prompt_len", type=int, default=159, help="the peers' full-size prompt")
    parser.add_argument("--new_tokens", type=int, default=34)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 (weights, KV)")
    parser.add_argument(
        "--attention_buckets",
        type=int,
        default=0,
        help="SamplingConfig.attention_buckets (0: the default)",
    )
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.bench_step import matmul_peak
    from grpo_jax.models.loading import load_hf_checkpoint
    from grpo_jax.sampling import SamplingConfig, generate

    if args.random:
        from grpo_jax.models import get_preset
        from grpo_jax.models.transformer import random_params

        cfg = get_preset(args.random, dtype=args.dtype, param_dtype=args.dtype)
        graphdef, params = random_params(cfg, 0)
    else:
        ckpt = args.checkpoint
        if not ckpt:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
            import common

            ckpt = common.model_dir()
        if not os.path.isfile(os.path.join(ckpt, "model.safetensors")):
            raise SystemExit(
                f"{ckpt}/model.safetensors missing: run benchmarks/peers/prepare.py first"
            )
        cfg, graphdef, params = load_hf_checkpoint(ckpt, dtype=args.dtype)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    n_embed = cfg.vocab_size * cfg.hidden_size
    # matmul parameters per token: every layer weight + the (tied) LM head; the embedding lookup
    # is a gather, not a matmul
    n_matmul = n_params - (0 if cfg.tie_word_embeddings else n_embed)
    item = jnp.dtype(args.dtype).itemsize
    weight_bytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_bytes_per_pos = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * item

    bw = read_bandwidth()
    # an accelerator: its published HBM bandwidth (experiments.aot.CHIPS, with sources) is the
    # bound; the measured read bandwidth is printed beside it
    from experiments.aot import chip_of_device

    chip = chip_of_device(jax.devices()[0].device_kind)
    if chip is not None and chip.bandwidth_Bps:
        bw["published"] = chip.bandwidth_Bps
        bw["chip"] = chip.name
        bw["best"] = chip.bandwidth_Bps
        print(f"chip: {chip.name}, published HBM bandwidth {chip.bandwidth_Bps / 1e9:.0f} GB/s")
    peak = matmul_peak(dtype=args.dtype)
    print(
        f"read bandwidth: jax sum {bw['jax_sum'] / 1e9:.1f} GB/s, numpy sum "
        f"{bw['numpy_sum'] / 1e9:.1f} GB/s -> BW = {bw['best'] / 1e9:.1f} GB/s; "
        f"{args.dtype} matmul peak {peak / 1e9:.1f} GFLOP/s"
    )
    print(
        f"model: {n_params / 1e6:.1f}M parameters ({weight_bytes / 2**20:.0f} MiB float32), "
        f"KV {kv_bytes_per_pos / 1024:.1f} KiB per position per row"
    )

    N, Lp = args.new_tokens, args.prompt_len
    rng = np.random.default_rng(0)
    results = []
    for B in [int(r) for r in args.rows.split(",") if r]:
        toks = jnp.asarray(rng.integers(100, cfg.vocab_size, (B, Lp)), jnp.int32)
        mask = jnp.ones((B, Lp), bool)

        def run(n, seed):
            sc = SamplingConfig(
                max_new_tokens=n, temperature=1.0, top_k=0, top_p=1.0, eos_ids=(), pad_id=0
            )
            if args.attention_buckets:
                sc = dataclasses.replace(sc, attention_buckets=args.attention_buckets)
            t = time.perf_counter()
            out = generate(graphdef, params, toks, mask, jax.random.key(seed), sc)
            out.completion_tokens.block_until_ready()
            return time.perf_counter() - t

        run(N, 0), run(2, 0)  # compile both
        t_n = min(run(N, s + 1) for s in range(args.repeats))
        t_2 = min(run(2, s + 1) for s in range(args.repeats))
        step = (t_n - t_2) / (N - 2)
        tok_s = B / step
        mean_pos = Lp + (2 + N) / 2  # positions read, averaged over the timed steps
        bytes_needed = weight_bytes + B * kv_bytes_per_pos * mean_pos
        # as implemented: each timed step reads its attention bucket's slots (older samplers
        # without buckets read all Lp + N)
        try:
            from grpo_jax.sampling import decode_buckets

            ends = decode_buckets(
                Lp, N, args.attention_buckets or SamplingConfig(max_new_tokens=N).attention_buckets
            )
            read = [next(e for e in ends if e >= Lp + i) for i in range(2, N)]
            mean_read = sum(read) / len(read)
        except ImportError:
            mean_read = Lp + N
        bytes_read = weight_bytes + B * kv_bytes_per_pos * mean_read
        bound = B * bw["best"] / bytes_needed
        compute_bound = peak / (2 * n_matmul)  # tokens/s at the matmul peak, any batch
        r = {
            "rows": B,
            "prompt_len": Lp,
            "decode_step_s": step,
            "decode_tok_s": tok_s,
            "bytes_per_step_needed": bytes_needed,
            "bytes_per_step_as_implemented": bytes_read,
            "bandwidth_bound_tok_s": bound,
            "fraction_of_bandwidth_bound": tok_s / bound,
            "achieved_read_GBps_as_implemented": bytes_read / step / 1e9,
            "compute_bound_tok_s": compute_bound,
            "fraction_of_compute_bound": tok_s / compute_bound,
            "prefill_plus_2_s": t_2,
        }
        results.append(r)
        print(
            f"rows {B:4d}: decode step {step * 1e3:8.1f} ms = {tok_s:8.1f} tok/s; bandwidth bound "
            f"{bound:8.1f} tok/s ({100 * tok_s / bound:5.1f}%); compute bound "
            f"{compute_bound:8.1f} tok/s ({100 * tok_s / compute_bound:5.1f}%)",
            flush=True,
        )
    summary = {
        "read_bandwidth_Bps": bw,
        "matmul_peak_flops": peak,
        "n_params": n_params,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_position": kv_bytes_per_pos,
        "new_tokens": N,
        "results": results,
        "devices": [str(d) for d in jax.devices()],
        "jax_version": jax.__version__,
        "model": args.random or "checkpoint",
    }
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
