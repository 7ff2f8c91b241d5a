"""Benchmark: chunked vs naive log-probs + GRPO loss + gradient (memory and time).

For each variant the step is `value_and_grad` of `policy_loss(token_logprobs(logits), ...)`
(token-mean, ratio 1) w.r.t. either
- `logits`: the `[R, T, V]` logits themselves (bfloat16 by default), or
- `projection`: a small final projection `W [H, V]` with `logits = hidden [R, T, H] @ W`
  (the logits are then an intermediate, as in a real model).

`naive` materialises `log_softmax(logits.astype(float32))`; `chunked` is
`grpo_jax.logprobs.token_logprobs` (float32 log-softmax `--chunk-size` positions at a time, chunked
backward pass).

Memory is XLA's compiled memory analysis (`jax.jit(f).lower(...).compile().memory_analysis()`,
temp + argument + output bytes) at the FULL shape (default R=64, T=4096, V=151,936), from
`jax.ShapeDtypeStruct`s: compile only, nothing is allocated. Time is measured at a reduced
shape (`--time-*` flags) that runs on a CPU. Numbers are for the backend JAX runs on; note
that XLA:CPU has no native bfloat16, so some bf16 buffers become f32 there (see
`grpo_jax.logprobs._sliceable_view`).

  PYTHONPATH=. python benchmarks/bench_logprobs.py       # defaults, < 2 min on a laptop CPU
  PYTHONPATH=. python benchmarks/bench_logprobs.py --mode projection --hidden 64
  PYTHONPATH=. python benchmarks/bench_logprobs.py --dtype float32 --no-time
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import logprobs as logprobs_lib
from grpo_jax import losses


def naive_token_logprobs(logits, tokens, temperature=1.0):
    x = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)[:, :-1]
    return jnp.take_along_axis(x, tokens[:, 1:, None], axis=-1)[..., 0]


def make_step(variant: str, mode: str, chunk_size: int):
    def logprobs(logits, tokens):
        if variant == "naive":
            return naive_token_logprobs(logits, tokens)
        return logprobs_lib.token_logprobs(logits, tokens, chunk_size=chunk_size)

    def loss_from_logits(logits, tokens, adv, mask):
        lp = logprobs(logits, tokens)
        return losses.policy_loss(lp, jax.lax.stop_gradient(lp), adv, mask)[0]

    if mode == "logits":
        return jax.jit(jax.value_and_grad(loss_from_logits))

    def loss_from_projection(w, hidden, tokens, adv, mask):
        return loss_from_logits(hidden @ w, tokens, adv, mask)

    return jax.jit(jax.value_and_grad(loss_from_projection))


def shapes(mode, r, t, v, h, dtype):
    tok = jax.ShapeDtypeStruct((r, t), jnp.int32)
    adv = jax.ShapeDtypeStruct((r,), jnp.float32)
    mask = jax.ShapeDtypeStruct((r, t - 1), jnp.float32)
    if mode == "logits":
        return (jax.ShapeDtypeStruct((r, t, v), dtype), tok, adv, mask)
    return (
        jax.ShapeDtypeStruct((h, v), dtype),
        jax.ShapeDtypeStruct((r, t, h), dtype),
        tok,
        adv,
        mask,
    )


def concrete(mode, r, t, v, h, dtype, seed=0):
    rng = np.random.default_rng(seed)
    tok = jnp.asarray(rng.integers(0, v, size=(r, t)), jnp.int32)
    adv = jnp.asarray(rng.normal(size=r), jnp.float32)
    mask = jnp.asarray(np.arange(t - 1)[None] < rng.integers(1, t, size=r)[:, None], jnp.float32)
    if mode == "logits":
        return (jnp.asarray(rng.normal(size=(r, t, v)), dtype), tok, adv, mask)
    return (
        jnp.asarray(rng.normal(size=(h, v)) / np.sqrt(h), dtype),
        jnp.asarray(rng.normal(size=(r, t, h)), dtype),
        tok,
        adv,
        mask,
    )


def memory(step, args):
    t0 = time.perf_counter()
    ma = step.lower(*args).compile().memory_analysis()
    temp, arg, out = ma.temp_size_in_bytes, ma.argument_size_in_bytes, ma.output_size_in_bytes
    alias = getattr(ma, "alias_size_in_bytes", 0)
    return dict(
        temp=temp,
        arg=arg,
        out=out,
        total=temp + arg + out - alias,
        compile_s=time.perf_counter() - t0,
    )


def timing(step, args, iters):
    jax.block_until_ready(step(*args))  # compile + warm up
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(step(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def gib(x):
    return f"{x / 2**30:9.2f}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=["logits", "projection", "both"], default="both")
    p.add_argument("--rows", type=int, default=64, help="R for the memory analysis")
    p.add_argument("--seq", type=int, default=4096, help="T for the memory analysis")
    p.add_argument("--vocab", type=int, default=151936, help="V for the memory analysis")
    p.add_argument("--hidden", type=int, default=64, help="H of the final projection")
    p.add_argument("--time-rows", type=int, default=2)
    p.add_argument("--time-seq", type=int, default=512)
    p.add_argument("--time-vocab", type=int, default=16384)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--chunk-size", type=int, default=logprobs_lib.DEFAULT_CHUNK_SIZE)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--no-time", action="store_true", help="memory analysis only")
    a = p.parse_args()
    dtype = jnp.dtype(a.dtype)
    modes = ["logits", "projection"] if a.mode == "both" else [a.mode]

    print(
        f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} "
        f"dtype={a.dtype} chunk_size={a.chunk_size}"
    )
    print(
        f"memory at R={a.rows} T={a.seq} V={a.vocab} (H={a.hidden}); time at "
        f"R={a.time_rows} T={a.time_seq} V={a.time_vocab}, best of {a.iters}"
    )
    one = a.rows * a.seq * a.vocab
    print(
        f"reference sizes: logits {a.dtype} {gib(one * dtype.itemsize).strip()} GiB, "
        f"one float32 copy {gib(one * 4).strip()} GiB"
    )
    header = (
        f"{'grad wrt':<11}{'variant':<9}{'temp GiB':>10}{'args GiB':>10}{'out GiB':>10}"
        f"{'total GiB':>10}{'compile s':>10}{'time ms':>10}"
    )
    print(header)
    print("-" * len(header))
    for mode in modes:
        for variant in ("naive", "chunked"):
            step = make_step(variant, mode, a.chunk_size)
            m = memory(step, shapes(mode, a.rows, a.seq, a.vocab, a.hidden, dtype))
            ms = float("nan")
            if not a.no_time:
                args = concrete(mode, a.time_rows, a.time_seq, a.time_vocab, a.hidden, dtype)
                ms = 1e3 * timing(make_step(variant, mode, a.chunk_size), args, a.iters)
            print(
                f"{mode:<11}{variant:<9}{gib(m['temp']):>10}{gib(m['arg']):>10}"
                f"{gib(m['out']):>10}{gib(m['total']):>10}{m['compile_s']:>10.1f}"
                f"{ms:>10.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
