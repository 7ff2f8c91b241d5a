"""A/B: the update and the log-prob pass on padded rows vs packed token buffers
(``config.algorithm.pack_sequences``), on real long-tailed completion lengths.

  python benchmarks/bench_packing.py            # budgets 512 and 1024 tokens; ~15 min on 2 cores
  python benchmarks/bench_packing.py --rows=4 --layers=1 --max_new_tokens=64 --out=/tmp/p.json

Workload: ``--rows`` rollouts, prompts left-padded to ``--prompt_len`` with real lengths drawn
uniformly from [prompt_len / 2, prompt_len], completions of lengths drawn from
``--lengths_file`` (default: SmolLM2-135M-Instruct's own GSM8K completions at a 512-token
budget, `benchmarks/gsm8k_lengths.py`, 48% of them cut at 512), at each completion budget of
``--max_new_tokens`` (a longer sample is cut there, as the sampler would; at budgets above 512
the cut samples would have run longer, so those rows are shorter than a real run's). Model: the
SmolLM2-135M architecture (random weights; speed does not depend on the values) with
``--layers`` layers, float32, one CPU process, built as a run builds it
(`grpo_jax.experiment.build_experiment`, no data).

Both layouts get the same token budget per forward/backward: ``--micro_rows`` padded rows of
``Lp + Lc - 1`` model tokens, or ``--micro_rows`` packed buffers of that length. Timed (best of
``--repeats`` interleaved calls after compilation): `steps.policy_gradients` (loss + gradients
of one mini-batch of all rows: the update's core; GRPO loss, seq-mean-token-mean) and the
reference / old-log-prob pass (`Steps.logprobs`). Reported: seconds, real tokens per second,
the model tokens and LM-head positions each layout computes, micro-batch counts, and the
largest difference of loss, gradients and log-probs between the two layouts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_rollouts import read_lengths
from benchmarks.bench_step import cpu_model


def _best(fns: dict, repeats: int) -> dict:
    """Best-of-``repeats`` seconds of each call after its compilation, the calls interleaved
    (A, B, A, B, ...) so that a busy machine slows both alike."""
    import jax

    for fn in fns.values():
        jax.block_until_ready(fn())  # compile
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t)
    return {name: min(v) for name, v in times.items()}


def measure(args, Lc: int) -> dict:
    """The workload and the four timings at a completion budget of ``Lc`` tokens."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from experiments.memory import _experiment_config
    from grpo_jax import experiment, steps
    from grpo_jax.models import get_preset
    from grpo_jax.state import Batch

    R, Lp = args.rows, args.prompt_len
    model_cfg = get_preset("smollm2-135m", num_layers=args.layers)
    cfg = _experiment_config(model_cfg, "grpo", R, Lp, Lc, kl_coef=0.0)
    cfg.algorithm.micro_batch_size = args.micro_rows
    exp = experiment.build_experiment(cfg, with_data=False)
    fns = steps.make_steps(exp)
    params = steps.init_train_state(exp).params

    rng = np.random.default_rng(args.seed)
    comp = np.minimum(rng.choice(read_lengths(args.lengths_file), R), Lc)
    prompt = rng.integers(Lp // 2, Lp + 1, R)
    cols = np.arange(Lp + Lc)[None]
    attn = ((cols >= Lp - prompt[:, None]) & (cols < Lp)) | (
        (cols >= Lp) & (cols < Lp + comp[:, None])
    )
    batch = Batch(
        tokens=jnp.asarray(rng.integers(1, model_cfg.vocab_size, (R, Lp + Lc)), jnp.int32),
        attention_mask=jnp.asarray(attn),
        completion_mask=jnp.asarray(attn[:, Lp:], jnp.float32),
        advantages=jnp.asarray(rng.normal(size=R), jnp.float32),
        sample_weights=jnp.ones((R,), jnp.float32),
        old_logprobs=None,
        ref_logprobs=None,
        sampler_logprobs=None,
    )
    micro = steps.packed_logprob_plan(exp, attn)  # k = micro_rows buffers of Lp + Lc - 1
    grads = jax.jit(steps.policy_gradients(exp))
    real_tokens = int(attn[:, :-1].sum())
    workload = {
        "max_new_tokens": Lc,
        "completion_mean": float(comp.mean()),
        "completion_max": int(comp.max()),
        "prompt_mean": float(prompt.mean()),
        "real_model_tokens": real_tokens,
        "padded_model_tokens": R * (Lp + Lc - 1),
        "packed_model_tokens": int(np.prod(micro.segment_ids.shape)),
        "padded_lm_head_positions": R * Lc,
        "packed_lm_head_positions": int(np.prod(micro.head_slot.shape)),
        "packed_micro_batches": micro.num_micro,
        "buffers_per_micro": int(micro.segment_ids.shape[1]),
        "padded_micro_batches": R // args.micro_rows,
    }
    print(json.dumps(workload), flush=True)
    calls = {
        "update_padded": lambda: grads(params, batch),
        "update_packed": lambda: grads(params, batch, micro),
        "logprobs_padded": lambda: fns.logprobs(params, batch.tokens, batch.attention_mask),
        "logprobs_packed": lambda: fns.logprobs(params, batch.tokens, batch.attention_mask, micro),
    }
    res = {}
    for name, s in _best(calls, args.repeats).items():
        res[name] = {"seconds": round(s, 3), "real_tokens_per_s": round(real_tokens / s, 1)}
        print(f"Lc={Lc} {name:16s} {s:8.3f} s  {real_tokens / s:9.1f} real tokens/s", flush=True)
    for what in ("update", "logprobs"):
        res[f"{what}_speedup"] = round(
            res[f"{what}_padded"]["seconds"] / res[f"{what}_packed"]["seconds"], 3
        )
    l0, _, g0 = grads(params, batch)
    l1, _, g1 = grads(params, batch, micro)
    lp0 = np.asarray(fns.logprobs(params, batch.tokens, batch.attention_mask))
    lp1 = np.asarray(fns.logprobs(params, batch.tokens, batch.attention_mask, micro))
    res["max_abs_diff"] = {
        "loss": float(abs(l1 - l0)),
        "grads": max(
            float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1))
        ),
        "logprobs": float(np.abs(lp1 - lp0)[attn[:, Lp:]].max()),
    }
    return {"workload": workload, "results": res}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument(
        "--max_new_tokens", default="512,1024", help="completion budgets, comma-separated"
    )
    ap.add_argument("--lengths_file", default="reports/gsm8k_lengths.json")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--micro_rows", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="reports/packing_cpu.json")
    args = ap.parse_args(argv)

    import jax

    out = {
        "settings": vars(args),
        "budgets": [measure(args, int(b)) for b in str(args.max_new_tokens).split(",")],
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPU core(s)",
        "date": datetime.date.today().isoformat(),
    }
    print(json.dumps(out["budgets"], indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
