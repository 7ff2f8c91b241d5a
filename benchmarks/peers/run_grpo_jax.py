"""grpo_jax on the peer-comparison workload (see common.py), timed per phase.

  python benchmarks/peers/run_grpo_jax.py --out=/tmp/peers/grpo_jax.json
  python benchmarks/peers/run_grpo_jax.py --prompts=2 --samples=2 \
      --max_new_tokens=16 --steps=2                       # tiny smoke size

Builds the experiment from configs/gsm8k_smollm2.py with overrides (the converted float32
safetensors, the first N GSM8K train problems, N x samples rollouts, one whole-batch update,
kl_coef, T=1) and times `grpo_jax.train.rl_step`, whose metrics row carries time/generate,
time/reward, time/reference, time/update. `--profile_dir` also writes a jax.profiler trace of
the last timed step (TensorBoard / Perfetto).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

sys.path.insert(0, common.REPO)


def make_config(args, prompt_len: int):
    from configs import gsm8k_smollm2

    c = gsm8k_smollm2.get_config("grpo")
    c.seed = args.seed
    c.steps = args.warmup + args.steps
    c.model.gguf_path = ""
    c.model.hf_checkpoint = common.model_dir()  # the same float32 safetensors as the peers
    c.model.dtype = c.model.param_dtype = "float32"
    c.model.remat = bool(getattr(args, "remat", False))
    c.data.source_dir = common.data_dir()
    c.data.max_train_examples = args.prompts  # the first N train problems
    c.data.max_prompt_tokens = prompt_len  # pad to the longest prompt (as TRL does)
    c.rollout.prompts_per_step = args.prompts
    c.rollout.rollouts_per_prompt = args.samples
    c.rollout.max_new_tokens = args.max_new_tokens
    c.rollout.temperature = args.temperature
    c.rollout.top_k, c.rollout.top_p = 0, 1.0
    c.algorithm.kl_coef = args.kl_coef
    c.algorithm.num_iterations = 1
    c.algorithm.mini_batch_size = 0  # one gradient step on the whole batch
    mb = common.micro_batch_rows(args)
    # gradient accumulation over micro-batches of rows (also the reference pass's chunk)
    c.algorithm.micro_batch_size = 0 if mb == args.prompts * args.samples else mb
    c.rollout.generate_batch_size = 0  # generation: the whole batch at once
    # each group's prompt runs once in the prefill, the reference pass and the update (same values)
    c.algorithm.shared_prompt_forward = not getattr(args, "no_shared_prompt", False)
    c.optimizer.learning_rate = args.learning_rate
    c.eval.datasets = ()
    c.logging.progress_bar = False
    c.logging.tensorboard = False
    return c


def main(argv=None):
    parser = common.add_workload_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument(
        "--profile_dir", default="", help="jax.profiler trace of the last timed step"
    )
    parser.add_argument(
        "--no_shared_prompt",
        action="store_true",
        help="run every row's prompt (algorithm.shared_prompt_forward=False)",
    )
    parser.add_argument(
        "--remat",
        action="store_true",
        help="rematerialise activations per layer in the update (less memory)",
    )
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from grpo_jax import steps as steps_lib
    from grpo_jax import train
    from grpo_jax.experiment import build_experiment

    prompts = common.load_prompts(args.prompts)
    prompt_len = max(len(p["ids"]) for p in prompts)
    config = make_config(args, prompt_len)
    exp = build_experiment(config)
    # the experiment's prompts must be exactly the prepared ones (same ids, left-padded)
    if len(exp.pool.examples) != args.prompts:
        raise SystemExit(f"grpo_jax kept {len(exp.pool.examples)} of {args.prompts} prompts")
    for i, p in enumerate(prompts):
        got = exp.pool.tokens[i][exp.pool.mask[i]].tolist()
        if got != p["ids"]:
            raise SystemExit(f"prompt {i}: grpo_jax token ids differ from prompts.json")
    prompt_tokens_per_step = args.samples * sum(len(p["ids"]) for p in prompts)

    run, _ = steps_lib.init_run(exp, warm_start=False)  # RL from the checkpoint (no SFT)
    from flax import nnx

    ids0 = np.asarray([prompts[0]["ids"]], np.int32)
    logits0, _ = nnx.merge(exp.graphdef, run.train.params)(
        ids0, np.arange(ids0.shape[1], dtype=np.int32)[None], np.ones(ids0.shape, bool)
    )
    nll0 = common.prompt_nll(np.asarray(logits0[0]), prompts[0]["ids"])
    print(f"[grpo_jax] prompt 0 NLL {nll0:.5f}", flush=True)
    fns = steps_lib.make_steps(exp)
    source = exp.make_source()
    steps = []
    total = args.warmup + args.steps
    clock = {"t0": time.perf_counter()}

    def record(result) -> None:  # after each step: its wall time and phases (and the profile)
        jax.block_until_ready(result.run.train.params)
        wall, i, row = time.perf_counter() - clock["t0"], int(result.run.train.step) - 1, result.row
        if args.profile_dir and i == total - 1:
            jax.profiler.stop_trace()
        step = {
            "step_s": wall,
            "generate_s": row["time/generate"],
            "reward_s": row["time/reward"],
            "reference_s": row["time/reference"],
            "update_s": row["time/update"],
            "other_s": wall
            - row["time/generate"]
            - row["time/reward"]
            - row["time/reference"]
            - row["time/update"],
            "generated_tokens": int(row["generated_tokens"]),
            "update_tokens": prompt_tokens_per_step + int(row["generated_tokens"]),
            "reward_mean": row["reward_mean"],
            "loss": row.get("loss"),
            "kl": row.get("kl"),
            "rss_gib": common.current_rss_bytes() / 2**30,
            "peak_rss_gib": common.peak_rss_bytes() / 2**30,
        }
        steps.append(step)
        print(
            f"[grpo_jax] step {i}{' (warm-up)' if i < args.warmup else ''}: "
            + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in step.items()
            ),
            flush=True,
        )
        if args.profile_dir and i == total - 2:  # the last step is profiled
            jax.profiler.start_trace(args.profile_dir)
        clock["t0"] = time.perf_counter()

    if args.profile_dir and total == 1:
        jax.profiler.start_trace(args.profile_dir)
    run, _ = train.run_steps(exp, fns, run, source, until=total, hooks=(record,))
    exp.close()
    # the update's model FLOPs (matmuls actually run: 6 x params x positions for the layers, the LM
    # head on the completion positions only, attention scores/values; Kaplan et al. 2020 eq. 2.1
    # plus the attention term) and the float32 matmul peak measured in this process
    sys.path.insert(0, os.path.join(common.REPO, "benchmarks"))
    from bench_step import matmul_peak

    peak = matmul_peak()
    mc = exp.model_config
    n_params = sum(int(x.size) for x in jax.tree.leaves(run.train.params))
    n_head = mc.vocab_size * mc.hidden_size
    n_body = n_params - n_head if mc.tie_word_embeddings else n_params - 2 * n_head
    R, Lc, Lp = args.prompts * args.samples, exp.max_new_tokens, exp.prompt_len
    # positions the update runs (padded shapes) and attention query-key pairs; with the shared
    # prompt forward each group's prompt runs once
    if exp.batching.prompt_group_size > 1:
        positions = args.prompts * Lp + R * (Lc - 1)
        pairs = args.prompts * Lp * Lp + R * (Lc - 1) * (Lp + Lc - 1)
    else:
        positions, pairs = R * (Lp + Lc - 1), R * (Lp + Lc - 1) ** 2
    update_flops = (
        6 * n_body * positions
        + 6 * n_head * R * Lc
        + 12 * mc.num_layers * mc.num_heads * mc.head_dim * pairs
    )
    upd = sorted(s["update_s"] for s in steps[args.warmup :])
    med_update = upd[len(upd) // 2] if upd else float("nan")
    print(
        f"[grpo_jax] update {update_flops / 1e12:.2f} TFLOP per step, "
        f"{update_flops / med_update / 1e9:.1f} GFLOP/s = "
        f"{100 * update_flops / med_update / peak:.1f}% of the float32 matmul peak "
        f"{peak / 1e9:.1f} GFLOP/s (same run)",
        flush=True,
    )
    mb = common.micro_batch_rows(args)
    notes = (
        (["update with per-layer rematerialisation (--remat)"] if args.remat else [])
        + (
            ["shared prompt forward OFF (--no_shared_prompt): every row runs its prompt"]
            if args.no_shared_prompt
            else [
                "algorithm.shared_prompt_forward: each group's prompt runs once in the prefill, "
                "the reference pass and the update (values equal the per-row computation up to "
                f"float rounding; TRL and Tunix run the prompt for each of the {args.samples} rows)"
            ]
        )
        + [
            f"reference pass and update in micro-batches of {mb} rows (gradients summed, one "
            "optimizer step; `algorithm.micro_batch_size`)",
            f"prompts left-padded to {prompt_len} tokens (the longest of the {args.prompts})",
            "generation runs max_new_tokens decode steps for the whole batch (static shapes); "
            "finished rows are masked",
        ]
    )
    R = args.prompts * args.samples
    G = int(getattr(exp.train_sampling, "prompt_group_size", 1))
    slots = int(getattr(exp.train_sampling, "decode_slots", 0) or 0)
    try:  # the sampler grows its cache in chunks (grpo_jax.sampling.decode_buckets)
        from grpo_jax import sampling

        ends = sampling.decode_buckets(
            Lp, Lc, int(getattr(exp.train_sampling, "attention_buckets", 1))
        )
    except (AttributeError, TypeError):
        ends = (Lp + Lc - 1,)
    if slots:
        cache_len = Lp + Lc
        cache = (
            f"continuous batching: {slots} decode rows x {cache_len} slots "
            f"(prompt {Lp} + max_new_tokens {Lc})"
        )
    else:
        cache_len = ends[-1] if ends else Lp
        cache = (
            f"static per-row cache: prompt {Lp} (left-padded to the longest) + max_new_tokens "
            f"{Lc} - 1 = {cache_len} slots at most (the last sampled token is never fed back), "
            f"in {len(ends)} decode chunk(s) of growing length (attention_buckets; the cache "
            "grows between chunks), so a decode step attends to at most ~16 slots more than "
            "it needs"
            + (
                f"; the prompt is prefilled once per group of {G} and its cache copied"
                if G > 1
                else ""
            )
        )
    settings = {
        "sampler": "grpo_jax.sampling (jitted, static shapes)",
        "cache_len": cache_len,
        "cache": cache,
        "prompt_pad": prompt_len,
        "generate_rows": R,
        "micro_batch_rows": mb,
        "optimizer_steps": 1,
        "remat": "on (--remat)" if args.remat else "off (model.remat=False)",
        "dtype": f"{config.model.param_dtype} params, {config.model.dtype} compute",
        "shared_prompt": bool(config.algorithm.shared_prompt_forward),  # run_all's floor
    }
    common.write_result(
        args,
        "grpo_jax",
        f"grpo_jax (jax {jax.__version__})",
        steps,
        notes,
        extra={
            "devices": [str(d) for d in jax.devices()],
            "prompt_len": prompt_len,
            "prompt0_nll": nll0,
            "update_flops": update_flops,
            "matmul_peak_flops": peak,
            "n_params": n_params,
            "settings": settings,
        },
    )


if __name__ == "__main__":
    main()
